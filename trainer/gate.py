"""The promotion gate: candidate vs champion on held-out recent traces, never by loss.

Two measures, both must beat the champion by a margin (or, for a refresh of a champion older than
``GateConfig.refresh_after_s``, merely match it, or predict better within a slack of its simulated
speedup: see ``refresh_reason``):
- expected acceptance ``sum_x min(p(x), q(x))`` over the target's top-k at every accepted-path row
  of the held-out traces (a lower bound: the tail outside the top-k counts as 0);
- simulated speedup at the serving k: replay the held-out outputs step by step with the draft's
  greedy chain (optionally inside the hybrid policy, as serving/drafters/hybrid.py chooses: the
  suffix proposal when its confidence-weighted goodput is at least the learned drafter's at its
  per-token acceptance on the steps the hybrid gives it (``hybrid_acceptance``), else the learned
  draft, cut to its goodput-best length, when it beats plain decoding), count tokens per target
  forward, and charge each step with serving's cost model in target-step units (the verify cost
  measured for each drafted length, or a line up to the k+1-token verify where only that one was
  measured, plus the learned drafter's per-token cost).
The suffix proposals and their confidences are serving's own (feedback/suffix/draft.py, the core
of serving's SuffixDrafter): per-tenant indexes fed with the training traces as serving feeds
them, prompt lookup in each held-out request, the same match, confidences and cut-off.
The simulation assumes greedy verification against the recorded tokens (exact for temperature-0
traces; for sampled traces it measures agreement with the sampled continuation).
NaN/inf weights or a non-finite/diverged training loss are refused before any measurement.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from feedback.bus.trace import TraceRecord
from feedback.goodput import (
    LEARNED_BRANCHES,
    CostModel,
    best_k,
    draft_nodes,
    hybrid_choice,
    learned_goodput,
    suffix_goodput,
)
from feedback.suffix.draft import SuffixConfig, SuffixProposer
from trainer.eval_cache import evaluate_all
from trainer.students import RecordEval


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
    verify_costs: tuple[float, ...] | None = None
    """Measured cost of verifying 1..k drafts (a forward of 2..k+1 tokens) relative to one target
    step; None: linear from 1 to ``verify_cost``. On a CPU the curve is concave (a forward of 2
    tokens already costs ~1.2 steps, 5 tokens ~1.35), so the line under-charges short drafts."""
    branches: int = LEARNED_BRANCHES
    """Candidates per drafted position in serving's learned drafts (``LearnedDrafter.branches``):
    above 1 a learned draft is a tree of the drafter's runners-up along its greedy chain, whose
    acceptance the simulation counts (``StandaloneStudent.evaluate``) and whose verify it charges
    at length x branches nodes, at most k."""
    hybrid: bool = True
    """Simulate inside the hybrid policy with the suffix drafter (suffix first, else learned)."""
    refresh_after_s: float | None = 20.0
    """A candidate that is no worse than a learned champion on both measures is promoted anyway
    once that champion has been live this long: small updates, promoted often, keep the live
    drafter trained on recent traffic (the median trace -> live time), not only on what it had
    when it last beat its predecessor by the margin. None: only a candidate that beats it."""
    refresh_speedup_slack: float = 0.01
    """A refresh may also simulate up to this fraction slower than its champion where it predicts
    the target better (expected acceptance above the champion's by ``acceptance_margin``). The
    hybrid simulation's flat-rate choice asks a better learned drafter on more steps and charges
    every draft it asks for, where serving's hybrid keeps only the drafts the drafter's own
    probabilities still back (ARCHITECTURE.md, twenty-first session), so a deficit this small is
    within what it can tell. In five demos, nine refused candidates that predicted better than a
    learned champion by 0.006-0.068 simulated 0.06-2.2 % slower, eight of them under 1 %; on the
    held-out stream the slack gave 10 promotions in 4 runs against 2, at no speed cost visible at
    ~1 % (twenty-third session). Serving's rollback watch still judges every swap. 0: no slack."""


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
    """No NaN or inf in the weights training changes (all of them for a model with none that train:
    the frozen target layers a selfspec drafter shares are the target's, ~30M values a check)."""
    trained = [p for p in model.parameters() if p.requires_grad]
    tensors = trained or [t for t in model.state_dict().values() if t.is_floating_point()]
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def loss_healthy(losses: list[float], divergence_factor: float = 10.0) -> bool:
    """Finite, and the recent losses (the last tenth) are not an order of magnitude above the
    median of the ones before (a blown-up run). Losses of single small batches of online traffic
    are noisy and jump at a domain shift, so this only guards against divergence; whether the
    student got better is the held-out measures' call."""
    if not losses:
        return True
    if not all(math.isfinite(x) for x in losses):
        return False
    n_tail = max(1, len(losses) // 10)
    tail, before = losses[-n_tail:], losses[:-n_tail]
    if not before:
        return True
    return float(np.mean(tail)) <= divergence_factor * max(float(np.median(before)), 1e-6)


def build_suffix_index(records: list[TraceRecord], config: SuffixConfig | None = None) -> SuffixProposer:
    """Serving's suffix drafter after ``records`` finished: each tenant's index fed in order, as
    serving's trace consumer feeds it. ``config``: serving's suffix settings (default: read from
    the same ``SPECLOOP_SUFFIX_*`` environment serving reads)."""
    proposer = SuffixProposer(config)
    for r in records:
        proposer.observe(r.tenant, r.output_ids.tolist(), prompt_ids=r.prompt_ids.tolist())
    return proposer


def match_len(proposal: list[int], truth: np.ndarray) -> int:
    """Leading tokens of ``proposal`` equal to ``truth`` (greedy acceptance)."""
    n = 0
    for a, b in zip(proposal, truth):
        if int(a) != int(b):
            break
        n += 1
    return n


def learned_acceptance(accept_at: list[np.ndarray], k: int, leaf_end: list[np.ndarray | None] | None = None) -> float:
    """Per-token acceptance of a learned drafter's greedy k-chains (or trees), as serving estimates
    it live (serving/drafters/draft_tree.py ``tree_trial``: an accept-until-first-reject step with
    m of n accepted is m successes and 1 failure if m < n, unless the path ended on a runner-up,
    a leaf below which nothing was drafted: ``leaf_end``)."""
    acc = np.concatenate(accept_at) if accept_at else np.zeros(0)
    refused = acc < k
    if leaf_end is not None and any(e is not None for e in leaf_end):
        ends = np.concatenate([np.zeros(len(a), bool) if e is None else e for a, e in zip(accept_at, leaf_end)])
        refused &= ~ends
    successes, failures = float(acc.sum()), float(refused.sum())
    return successes / (successes + failures) if successes + failures else 0.0


def relative_costs(cfg: GateConfig):
    """Serving's CostModel in target-step units: verifying n drafts costs ``verify_costs[n - 1]``
    where measured, else 1 + n (verify_cost - 1) / k (linear between the one-token step and the
    k+1-token verify); a draft token costs draft_cost."""
    costs = CostModel(target_step_ms=1.0, draft_ms_per_token=cfg.draft_cost,
                      verify_slope=(cfg.verify_cost - 1.0) / cfg.k if cfg.k else 0.0)
    for n, c in enumerate(cfg.verify_costs or (), start=1):
        costs.observe_verify(n, float(c))  # first observation: taken as is
    return costs


def learned_length(acceptance: float, cfg: GateConfig) -> int:
    """The learned draft length serving's hybrid drafts at this acceptance (its ``learned_length``)."""
    return best_k(acceptance, cfg.k, relative_costs(cfg), cfg.branches)


def simulate(
    output: np.ndarray,
    prompt: np.ndarray,
    accept_at: np.ndarray | None,
    cfg: GateConfig,
    suffix: SuffixProposer | None,
    tenant: str = "default",
    acceptance: float | None = None,
    length: int | None = None,
    learned_steps: list[float] | None = None,
    leaf_end: np.ndarray | None = None,
) -> tuple[int, int, float]:
    """Replay one output: returns (tokens, target forwards, cost in target-step units).

    ``accept_at[p]``: leading tokens of the learned draft's greedy chain (length k) from output
    position p that match the output; None = no learned drafter. ``suffix`` drafts for the request
    as serving's suffix drafter would (``tenant``'s index, prompt lookup); nothing is added to its
    indexes. With both, each step takes what serving's hybrid drafter would (its goodput rule,
    in these cost units): the suffix draft when its expected tokens per cost, from its own
    confidences, are at least the learned drafter's at per-token ``acceptance`` (default: its rate
    on this output); else the learned draft when that beats plain decoding; else the suffix draft.
    Without ``suffix`` the learned draft runs at every step. The learned draft is ``length``
    tokens long (default: the goodput-best length at ``acceptance``, as serving's hybrid drafts).
    ``learned_steps``: [successes, failures] of the learned drafts taken, added to (the per-token
    acceptance serving would measure live on the steps it drafts; ``leaf_end[p]``: the path from p
    ended on a runner-up, which refused nothing).
    """
    n = len(output)
    p = steps = 0
    cost = 0.0
    costs = relative_costs(cfg)
    req = suffix.start(tenant, prompt, len(prompt)) if suffix is not None else None
    g_learned = 0.0
    if accept_at is not None:
        if acceptance is None:
            acceptance = learned_acceptance([accept_at], cfg.k, [leaf_end])
        if length is None:
            length = learned_length(acceptance, cfg)
        g_learned = learned_goodput(acceptance, length, costs, draft_nodes(length, cfg.branches, cfg.k))
    while p < n:
        remaining = n - p - 1  # the bonus token is always emitted
        use = "learned" if accept_at is not None else "none"
        if req is not None:
            draft = suffix.draft(req, cfg.k)
            g_suffix = suffix_goodput(draft.expected_accepted, len(draft.tokens), costs) if draft.tokens else 1.0
            use = hybrid_choice(len(draft.tokens), g_suffix, g_learned, g_none=1.0)  # serving's rule
        if use == "suffix":
            a = match_len(draft.tokens, output[p : p + cfg.k])
            cost += costs.verify_ms(len(draft.tokens))
        elif use == "learned":
            a = min(int(accept_at[p]), length)
            cost += costs.verify_ms(draft_nodes(length, cfg.branches, cfg.k)) + cfg.draft_cost * length
            if learned_steps is not None:
                learned_steps[0] += a
                learned_steps[1] += a < length and not (leaf_end is not None and leaf_end[p])
        else:
            a = 0
            cost += 1.0
        a = min(a, remaining)
        if req is not None:
            suffix.extend(req, [int(t) for t in output[p : p + a + 1]])
        p += a + 1
        steps += 1
    return n, steps, cost


def score(student, heldout: list[TraceRecord], cfg: GateConfig, suffix: SuffixProposer | None) -> DrafterScore:
    """``student``: a trainer.students.Student, or None for "no learned drafter" (suffix only)."""
    ea_sum, rows = 0.0, 0
    solo = [0, 0]
    pol = [0, 0.0]
    chains: list[RecordEval | None] = [None] * len(heldout)
    if student is not None:
        for i, (rec, ev) in enumerate(zip(heldout, evaluate_all(student, heldout, cfg.k, cfg.branches))):
            ea_sum += float(ev.overlap.sum())
            rows += int(ev.overlap.shape[0])
            t, s, _ = simulate(rec.output_ids, rec.prompt_ids, ev.accept_at, cfg, None, length=cfg.k,
                               leaf_end=ev.leaf_end)
            solo[0] += t
            solo[1] += s
            chains[i] = ev
    # Serving's live acceptance is an EMA over recent traffic, so while it serves one domain it
    # tracks that domain: each held-out request is simulated at its own domain's rate (one rate
    # over a mixed held-out set would under-rate a drafter that learned the current domain).
    by_domain: dict[str, list[RecordEval]] = {}
    for rec, ev in zip(heldout, chains):
        if ev is not None:
            by_domain.setdefault(rec.domain or "", []).append(ev)
    acceptance = {d: learned_acceptance([e.accept_at for e in evs], cfg.k, [e.leaf_end for e in evs])
                  for d, evs in by_domain.items()}
    if cfg.hybrid and suffix is not None and student is not None:
        acceptance = hybrid_acceptance(heldout, chains, cfg, suffix, acceptance)
    for rec, ev in zip(heldout, chains):
        t, _, c = simulate(rec.output_ids, rec.prompt_ids, None if ev is None else ev.accept_at, cfg,
                           suffix if cfg.hybrid else None, rec.tenant, acceptance.get(rec.domain or ""),
                           leaf_end=None if ev is None else ev.leaf_end)
        pol[0] += t
        pol[1] += c
    return DrafterScore(
        expected_acceptance=ea_sum / rows if rows else 0.0,
        sim_accept_len=solo[0] / solo[1] if solo[1] else 1.0,
        sim_speedup=pol[0] / pol[1] if pol[1] else 1.0,
        rows=rows,
    )


def hybrid_acceptance(heldout: list[TraceRecord], chains: list[RecordEval | None], cfg: GateConfig,
                      suffix: SuffixProposer, acceptance: dict[str, float], rounds: int = 3) -> dict[str, float]:
    """Per domain, the learned drafter's per-token acceptance on the steps the hybrid gives it.

    Serving's hybrid measures its learned acceptance live, on the steps where the learned draft
    was taken: those where the suffix index had nothing confident, which are the harder ones for
    any drafter. The rate over every position (``acceptance``, the start) overrates a drafter
    there, and a simulation at it takes learned drafts serving would soon stop taking. Iterate:
    simulate at the current rates, re-measure each domain's rate on the learned steps taken,
    until the rates settle (``rounds`` at most). A domain where no learned step was taken keeps
    its rate."""
    rates = dict(acceptance)
    for _ in range(rounds):
        steps: dict[str, list[float]] = {}
        for rec, ev in zip(heldout, chains):
            d = rec.domain or ""
            simulate(rec.output_ids, rec.prompt_ids, None if ev is None else ev.accept_at, cfg, suffix, rec.tenant,
                     rates.get(d), learned_steps=steps.setdefault(d, [0.0, 0.0]),
                     leaf_end=None if ev is None else ev.leaf_end)
        new = {d: (s / (s + f) if s + f else rates[d]) for d, (s, f) in steps.items() if d in rates}
        settled = all(abs(new[d] - rates[d]) < 1e-3 for d in new)
        rates.update(new)
        if settled:
            break
    return rates


def judge(
    candidate,
    champion,
    heldout: list[TraceRecord],
    cfg: GateConfig,
    *,
    suffix: SuffixProposer | None = None,
    losses: list[float] | None = None,
    champion_age_s: float | None = None,
) -> GateDecision:
    """Promote ``candidate`` over ``champion`` (None: suffix-only / no learned drafter)?
    ``champion_age_s``: how long the champion has been live (for a refresh, see GateConfig)."""
    if not weights_finite(candidate.model):
        return GateDecision(False, "candidate has non-finite weights", None, None)
    if not loss_healthy(losses or []):
        return GateDecision(False, "training loss is non-finite or diverged", None, None)
    if not heldout:
        return GateDecision(False, "no held-out traces yet", None, None)
    cand = score(candidate, heldout, cfg, suffix)
    champ = score(champion, heldout, cfg, suffix)
    if not (cand.expected_acceptance > champ.expected_acceptance + cfg.acceptance_margin):
        reason = (f"expected acceptance {cand.expected_acceptance:.4f} does not beat "
                  f"champion {champ.expected_acceptance:.4f} + {cfg.acceptance_margin}")
    elif not (cand.sim_speedup > champ.sim_speedup * (1.0 + cfg.speedup_margin)):
        reason = (f"simulated speedup {cand.sim_speedup:.4f} does not beat champion "
                  f"{champ.sim_speedup:.4f} x (1 + {cfg.speedup_margin})")
    else:
        return GateDecision(True, "candidate beats champion", cand, champ)
    stale = (champion is not None and cfg.refresh_after_s is not None and champion_age_s is not None
             and champion_age_s >= cfg.refresh_after_s)
    if stale and (why := refresh_reason(cand, champ, cfg)):
        return GateDecision(True, f"refresh: {why} a champion live for {champion_age_s:.0f} s "
                            f"(expected acceptance {cand.expected_acceptance:.4f} vs "
                            f"{champ.expected_acceptance:.4f}, simulated speedup {cand.sim_speedup:.4f} vs "
                            f"{champ.sim_speedup:.4f})", cand, champ)
    return GateDecision(False, reason, cand, champ)


def refresh_reason(cand: DrafterScore, champ: DrafterScore, cfg: GateConfig) -> str | None:
    """Why ``cand`` may refresh ``champ`` (a champion live long enough), or None: no worse on both
    measures, or a better predictor of the target within ``refresh_speedup_slack`` of its
    simulated speedup."""
    if cand.expected_acceptance >= champ.expected_acceptance and cand.sim_speedup >= champ.sim_speedup:
        return "candidate no worse than"
    if (cand.expected_acceptance > champ.expected_acceptance + cfg.acceptance_margin
            and cand.sim_speedup >= champ.sim_speedup * (1.0 - cfg.refresh_speedup_slack)):
        return f"candidate predicts better, simulated within {cfg.refresh_speedup_slack:.1%} of"
    return None
