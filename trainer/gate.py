"""The promotion gate: candidate vs champion on held-out recent traces, never by loss.

Two measures, both must beat the champion by a margin:
- expected acceptance ``sum_x min(p(x), q(x))`` over the target's top-k at every accepted-path row
  of the held-out traces (a lower bound: the tail outside the top-k counts as 0);
- simulated speedup at the serving k: replay the held-out outputs step by step with the draft's
  greedy chain (optionally inside the hybrid policy: the suffix proposal when it has one, else the
  learned draft), count tokens per target forward, and charge each step with the verify cost plus
  the learned drafter's per-token cost (relative to one target step).
The simulation assumes greedy verification against the recorded tokens (exact for temperature-0
traces; for sampled traces it measures agreement with the sampled continuation).
NaN/inf weights or a non-finite/diverged training loss are refused before any measurement.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from feedback.trace import TraceRecord
from trainer.suffix_sim import SuffixSim, match_len


@dataclass
class GateConfig:
    k: int = 4
    """Draft length the serving side runs at."""
    acceptance_margin: float = 0.005
    """Candidate expected acceptance must exceed the champion's by this (absolute)."""
    speedup_margin: float = 0.0
    """Candidate simulated speedup must exceed the champion's by this fraction."""
    draft_cost: float = 0.16
    """Cost of one learned draft token relative to one target step (pre-study: 0.16 standalone)."""
    verify_cost: float = 1.0
    """Cost of verifying k+1 tokens relative to one target decode step (measured 0.99-1.09)."""
    hybrid: bool = True
    """Simulate inside the hybrid policy with the suffix drafter (suffix first, else learned)."""


@dataclass
class DrafterScore:
    expected_acceptance: float
    sim_accept_len: float
    """Tokens per target forward with the learned drafter alone."""
    sim_speedup: float
    """Tokens per unit of time relative to plain decoding (policy per ``GateConfig.hybrid``)."""
    rows: int = 0

    def as_metrics(self, prefix: str) -> dict[str, float]:
        return {f"{prefix}{k}": float(v) for k, v in asdict(self).items()}


@dataclass
class GateDecision:
    promote: bool
    reason: str
    candidate: DrafterScore | None
    champion: DrafterScore | None
    details: dict = field(default_factory=dict)

    def as_metrics(self) -> dict[str, float]:
        out = {"gate_promote": float(self.promote)}
        if self.candidate:
            out |= self.candidate.as_metrics("cand_")
        if self.champion:
            out |= self.champion.as_metrics("champ_")
        return out


def weights_finite(model: torch.nn.Module) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in model.state_dict().values() if t.is_floating_point())


def loss_healthy(losses: list[float], divergence_factor: float = 3.0) -> bool:
    """Finite, and the recent losses are not far above the best seen (a diverged run)."""
    if not losses:
        return True
    if not all(math.isfinite(x) for x in losses):
        return False
    tail = losses[-max(1, len(losses) // 10) :]
    return float(np.mean(tail)) <= divergence_factor * max(min(losses), 1e-6)


def build_suffix_index(records: list[TraceRecord]) -> SuffixSim:
    sim = SuffixSim()
    for r in records:
        sim.add(np.concatenate([r.prompt_ids, r.output_ids]))
    return sim


def simulate(
    output: np.ndarray,
    prompt: np.ndarray,
    accept_at: np.ndarray | None,
    cfg: GateConfig,
    suffix: SuffixSim | None,
) -> tuple[int, int, float]:
    """Replay one output: returns (tokens, target forwards, cost in target-step units).

    ``accept_at[p]``: leading tokens of the learned draft's greedy chain (length k) from output
    position p that match the output; None = no learned drafter.
    """
    n = len(output)
    p = steps = 0
    cost = 0.0
    ctx = [int(t) for t in prompt]
    while p < n:
        remaining = n - p - 1  # the bonus token is always emitted
        proposal = suffix.propose(ctx, cfg.k) if suffix is not None else []
        if proposal:
            a = match_len(proposal, output[p : p + cfg.k])
            cost += cfg.verify_cost
        elif accept_at is not None:
            a = int(accept_at[p])
            cost += cfg.verify_cost + cfg.draft_cost * cfg.k
        else:
            a = 0
            cost += 1.0
        a = min(a, remaining)
        ctx.extend(int(t) for t in output[p : p + a + 1])
        p += a + 1
        steps += 1
    return n, steps, cost


def score(student, heldout: list[TraceRecord], cfg: GateConfig, suffix: SuffixSim | None) -> DrafterScore:
    """``student``: a trainer.students.Student, or None for "no learned drafter" (suffix only)."""
    ea_sum, rows = 0.0, 0
    solo = [0, 0]
    pol = [0, 0.0]
    for rec in heldout:
        if student is not None:
            ev = student.evaluate(rec, cfg.k)
            ea_sum += float(ev.overlap.sum())
            rows += int(ev.overlap.shape[0])
            t, s, _ = simulate(rec.output_ids, rec.prompt_ids, ev.accept_at, cfg, None)
            solo[0] += t
            solo[1] += s
            accept_at = ev.accept_at
        else:
            accept_at = None
        t, _, c = simulate(rec.output_ids, rec.prompt_ids, accept_at, cfg, suffix if cfg.hybrid else None)
        pol[0] += t
        pol[1] += c
    return DrafterScore(
        expected_acceptance=ea_sum / rows if rows else 0.0,
        sim_accept_len=solo[0] / solo[1] if solo[1] else 1.0,
        sim_speedup=pol[0] / pol[1] if pol[1] else 1.0,
        rows=rows,
    )


def judge(
    candidate,
    champion,
    heldout: list[TraceRecord],
    cfg: GateConfig,
    *,
    suffix: SuffixSim | None = None,
    losses: list[float] | None = None,
) -> GateDecision:
    """Promote ``candidate`` over ``champion`` (None: suffix-only / no learned drafter)?"""
    if not weights_finite(candidate.model):
        return GateDecision(False, "candidate has non-finite weights", None, None)
    if not loss_healthy(losses or []):
        return GateDecision(False, "training loss is non-finite or diverged", None, None)
    if not heldout:
        return GateDecision(False, "no held-out traces yet", None, None)
    cand = score(candidate, heldout, cfg, suffix)
    champ = score(champion, heldout, cfg, suffix)
    if not (cand.expected_acceptance > champ.expected_acceptance + cfg.acceptance_margin):
        return GateDecision(False, f"expected acceptance {cand.expected_acceptance:.4f} does not beat "
                            f"champion {champ.expected_acceptance:.4f} + {cfg.acceptance_margin}", cand, champ)
    if not (cand.sim_speedup > champ.sim_speedup * (1.0 + cfg.speedup_margin)):
        return GateDecision(False, f"simulated speedup {cand.sim_speedup:.4f} does not beat champion "
                            f"{champ.sim_speedup:.4f} x (1 + {cfg.speedup_margin})", cand, champ)
    return GateDecision(True, "candidate beats champion", cand, champ)
