"""Speedup figures of an online run read with their paired bootstrap interval."""

from __future__ import annotations

from infra.loop import Point
from infra.loop_metrics import paired_speedup_interval, summarise, tok_s


def _points(walls, tokens=48, failed=()):
    return [Point(i, "chat", tokens, w, 1.0, "v", failed=i in failed) for i, w in enumerate(walls)]


def test_the_interval_holds_the_ratio_and_widens_with_noise():
    base = _points([1.0] * 12)
    steady = _points([0.8] * 12)  # 1.25x on every request
    assert paired_speedup_interval(steady, base) == [1.25, 1.25]
    noisy = _points([0.6, 1.0] * 6)  # 1.25x overall, each pair 1.67x or 1.0x
    low, high = paired_speedup_interval(noisy, base)
    ratio = tok_s(noisy) / tok_s(base)
    assert low < ratio < high and high - low > 0.1
    assert paired_speedup_interval(noisy, base) == [low, high]  # seeded: one run, one answer


def test_failed_pairs_are_dropped_and_too_few_pairs_give_none():
    base = _points([1.0, 1.0, 1.0])
    ours = _points([0.5, 100.0, 0.5], failed={1})
    assert paired_speedup_interval(ours, base) == [2.0, 2.0]
    assert paired_speedup_interval(ours[:1], base[:1]) is None


def test_summarise_reports_the_intervals_beside_the_speedups():
    base = _points([1.0] * 9)
    ours = _points([0.5, 1.0, 0.8] * 3)
    out = summarise(ours, 6, baseline=base)
    for name in ("day0_speedup", "speedup_overall"):
        low, high = out[f"{name}_ci95"]
        assert low <= out[name] <= high, name


def test_each_trace_is_fresh_from_its_request_to_the_first_swap_after_the_trainer_polled_it():
    from infra.loop import freshness_per_trace

    served = [("r1", 10.0), ("r2", 20.0), ("r3", 30.0), ("r4", 40.0)]
    polled = {"r1": 11.0, "r2": 21.0, "r3": 50.0}  # r4: never polled
    events = [{"event": "swap", "at": 25.0, "version": "2"}, {"event": "rollback", "at": 26.0},
              {"event": "swap", "at": 60.0, "version": "3"}]
    got = freshness_per_trace(served, polled, events)
    assert got == [("2", 15.0), ("2", 5.0), ("3", 30.0)]
    assert freshness_per_trace(served, polled, events[:2]) == [("2", 15.0), ("2", 5.0)]  # r3: no swap after it
    per_version = {"2": 10.0, "3": 30.0}
    out = summarise(_points([1.0] * 4), 2, freshness=got)
    assert out["freshness_s_median"] == 15.0 and out["freshness_s_by_version"] == per_version
