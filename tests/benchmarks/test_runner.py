"""StepTimer: what the benchmarks read off the engine's step reports."""

from types import SimpleNamespace

import pytest

from benchmarks import runner
from benchmarks.runner import StepTimer


def _step(rows: int, accepted: int):
    return SimpleNamespace(draft_ms=0.1, verify_ms=1.0, request_ids=list(range(rows)),
                           num_drafted=[1] * rows, num_accepted=[accepted] + [0] * (rows - 1),
                           tree_nodes=None, draft_nodes=[1] * rows)


def test_full_batch_rate_times_each_full_step_from_the_previous_report(monkeypatch):
    clock = iter([0.0, 1.0, 3.0, 10.0, 11.0, 12.5])
    monkeypatch.setattr(runner.time, "perf_counter", lambda: next(clock))
    timer = StepTimer()
    timer.on_step(_step(2, 0))  # t = 0: opens the first segment, no interval of its own
    timer.on_step(_step(2, 1))  # t = 1: 3 tokens in 1 s
    timer.on_step(_step(2, 0))  # t = 3: 2 tokens in 2 s
    timer.new_segment()  # another engine ran in between
    timer.on_step(_step(2, 1))  # t = 10: the gap is not this step's
    timer.on_step(_step(1, 0))  # t = 11: a tail step of 1 row, not counted at 2
    timer.on_step(_step(2, 0))  # t = 12.5: 2 tokens in 1.5 s (including, e.g., an admission)
    rate, seconds = timer.full_batch_rate(2)
    assert seconds == pytest.approx(4.5)
    assert rate == pytest.approx(7 / 4.5)
    assert timer.full_batch_rate(1) == pytest.approx((1.0, 1.0))
    assert timer.full_batch_rate(4) is None
