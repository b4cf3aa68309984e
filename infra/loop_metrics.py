"""Figures of an online run (``bench online`` JSON, the demo's summary) from its Points."""

from __future__ import annotations

import statistics

import numpy as np

from infra.loop import OnlineLoop
from kernels.packed_linear import rounding_available


def rounds_on_this_cpu(bf16_activations: bool) -> bool:
    """Whether engines built with ``bf16_activations`` do round: where the CPU has a bf16 dot
    product or AMX tiles (elsewhere the forward stays fp32, and the figures say so)."""
    return bf16_activations and rounding_available()


def served_bf16_activations(settings) -> bool:
    """Whether the run's target served on bf16 activations: asked for
    (``ServingSettings.bf16_activations``) and possible on this CPU (``rounds_on_this_cpu``)."""
    return rounds_on_this_cpu(settings.serving.bf16_activations)


def shift_index(domains: list[str]) -> int:
    """Index of the first request whose domain differs from the first one (len if none)."""
    for i, d in enumerate(domains):
        if d != domains[0]:
            return i
    return len(domains)


def tok_s(points) -> float:
    ok = [p for p in points if not p.failed]
    wall = sum(p.wall_s for p in ok)
    return sum(p.tokens for p in ok) / wall if wall else 0.0


def mean_accept(points) -> float:
    ok = [p for p in points if not p.failed]
    return statistics.fmean(p.accept_len for p in ok) if ok else 0.0


def paired_speedup_interval(ours, theirs, level: float = 0.95, resamples: int = 2000,
                            seed: int = 0) -> list[float] | None:
    """[low, high] bootstrap interval of ``tok_s(ours) / tok_s(theirs)``, the requests paired by
    position (each served by both sides; pairs where either failed are dropped) and resampled with
    replacement: how far the ratio moves with which requests a window happened to hold. This VM
    moves a 7-request window by +-8 % between runs of one code (ARCHITECTURE.md), so a speedup
    figure is read with its interval. None with fewer than two pairs."""
    pairs = [(p.tokens, p.wall_s, b.tokens, b.wall_s) for p, b in zip(ours, theirs)
             if not p.failed and not b.failed]
    if len(pairs) < 2:
        return None
    table = np.asarray(pairs, dtype=np.float64)  # [n, 4]: our tokens, our wall, their tokens, wall
    picks = np.random.default_rng(seed).integers(0, len(pairs), size=(resamples, len(pairs)))
    sums = table[picks].sum(axis=1)  # [resamples, 4]
    ratios = (sums[:, 0] / sums[:, 1]) / (sums[:, 2] / sums[:, 3])
    low, high = np.quantile(ratios, [(1 - level) / 2, (1 + level) / 2])
    return [round(float(low), 4), round(float(high), 4)]


def tail(points, fraction: float = 1 / 3):
    """The last part of a domain (after adaptation)."""
    n = max(1, round(len(points) * fraction))
    return points[-n:]


def requests_to_recover(after, target_accept: float, window: int = 3) -> int | None:
    """Post-shift requests until the rolling mean tokens/verify reaches ``target_accept``."""
    for i in range(len(after)):
        recent = after[max(0, i - window + 1): i + 1]
        if len(recent) == min(window, len(after)) and mean_accept(recent) >= target_accept:
            return i + 1
    return None


def summarise(points, shift: int, *, baseline=None, frozen=None, swaps=0, rollbacks=0,
              freshness=None, drifts=None) -> dict:
    """``points``: the adapted run; ``baseline``: target-only Points on the same prompts;
    ``frozen``: Points of the drafter frozen at the shift on the post-shift prompts;
    ``freshness``: (version, seconds) per trace (OnlineLoop.freshness): their median, overall and
    per version."""
    before, after = points[:shift], points[shift:]
    out = {
        "requests": len(points),
        "shift_at": shift,
        "tok_s": tok_s(points),
        "mean_accept_len_before": mean_accept(before),
        "mean_accept_len_after": mean_accept(after),
        "swaps": swaps,
        "rollbacks": rollbacks,
        "acceptance_drifts": len(drifts or []),
        "drift_domains": ",".join(sorted({d["domain"] for d in drifts or []})) or "-",
        "failed_requests": sum(p.failed for p in points),
    }
    if baseline is not None:
        ours_tail = tail(before)
        base_tail = baseline[shift - len(ours_tail): shift]
        out["day0_speedup"] = tok_s(ours_tail) / tok_s(base_tail) if tok_s(base_tail) else None
        out["day0_speedup_ci95"] = paired_speedup_interval(ours_tail, base_tail)
        out["speedup_overall"] = tok_s(points) / tok_s(baseline) if tok_s(baseline) else None
        out["speedup_overall_ci95"] = paired_speedup_interval(points, baseline)
        out["lossless"] = all(p.output == b.output for p, b in zip(points, baseline) if not p.failed)
    if frozen is not None and after:
        out["static_vs_adapted_after_shift"] = tok_s(after) / tok_s(frozen) if tok_s(frozen) else None
        out["frozen_mean_accept_len_after"] = mean_accept(frozen)
        if baseline is not None:
            out["lossless"] = out["lossless"] and all(
                p.output == b.output for p, b in zip(frozen, baseline[shift:]) if not p.failed)
    if before and after:
        out["requests_to_recover"] = requests_to_recover(after, mean_accept(tail(before)))
    fresh = list(freshness or [])
    out["freshness_s_median"] = statistics.median(s for _, s in fresh) if fresh else None
    per: dict[str, list[float]] = {}
    for version, s in fresh:
        per.setdefault(version, []).append(s)
    out["freshness_s_by_version"] = {v: round(statistics.median(xs), 1) for v, xs in per.items()}
    return out


def trainer_figures(loop: OnlineLoop, **extra) -> dict:
    """What the loop's trainer did (nothing for the suffix drafter, which has none)."""
    if loop.trainer is None:
        return {}
    st = loop.trainer.stats
    return {"trainer_records_polled": st.records_polled, "trainer_rounds": st.rounds,
            "trainer_train_steps": st.train_steps, "trainer_promotions": st.promotions,
            "trainer_heldout_expected_acceptance": st.heldout_acceptance, "trainer_last_gate": st.last_decision,
            "trainer_drifts_seen": st.drifts, "trainer_traffic_shifts": st.traffic_shifts,
            "gate_costs": {k: _rounded(v) for k, v in loop.costs.items()}, **extra}


def _rounded(v):
    return [round(x, 4) for x in v] if isinstance(v, (list, tuple)) else round(v, 4)
