"""Hybrid drafter: per step and per row, the proposal with the higher expected goodput.

Goodput = expected tokens emitted by the verify step / its cost (draft + verify, ms):

    none     1 / verify(0)
    suffix   (1 + E_s) / verify(len_s)                 E_s = sum_j prod_{i<=j} confidence_i
    learned  (1 + sum_{j<=n} a^j) / (n * draft_ms_per_token + verify(n))     before calling it
             (1 + E_l) / verify(n)                      after (its cost is sunk; E_l from q)

where n <= k, the learned draft's length, is the one with the best prior goodput (``best_k``): a
drafter at acceptance 0.35 where each verified token costs 0.18 target steps (this CPU) pays with
n = 1 and loses with n = 4.

The suffix drafter costs ~nothing, so it runs for every row; a row whose suffix match is confident
(E_s >= ``suffix_threshold``, or, with no threshold, goodput above the learned drafter's prior) takes
it. Otherwise the learned drafter runs, batched over just those rows, when its prior goodput beats
both the suffix proposal and proposing nothing; ``a`` is its live per-token acceptance (EMA over
the steps it proposed), its draft cost is measured on every call, and the verify cost is measured
passively (time from a proposal to the first ``on_verified`` after it) unless disabled. A small
``explore`` fraction of the remaining rows still gets learned proposals so a drafter written off
early (or improved by a hot swap) keeps being measured; the fraction is cut so that those calls
cost at most ``explore_budget`` of serving time (``explore_fraction``).

Both drafters see every add_request / on_verified / remove_request, so the learned drafter's
per-request state stays in sync even for rows it did not draft (it commits their tokens lazily).
"""

from __future__ import annotations

import time

import numpy as np
import torch
from pydantic import BaseModel, Field

from feedback.bus.trace import DrafterKind
from feedback.goodput import (
    AcceptanceEstimate,
    CostModel,
    best_k,
    draft_nodes,
    hybrid_choice,
    learned_goodput,
    suffix_goodput,
    suffix_preferred,
)
from serving.drafters.base import Drafter, DraftProposal, DraftRequestView, chain_parents
from serving.drafters.draft_tree import tree_trial
from serving.engine.probes import sit_out_after
from serving.engine.tree import path_confidence

_MOST_SIT_OUT = 63
"""The longest the learned drafter sits out after cuts in a row (``on_cut``)."""


class HybridPolicy(BaseModel):
    """Knobs of the per-row choice."""

    suffix_threshold: float | None = Field(
        None,
        description="Expected accepted suffix tokens at or above which the suffix proposal is "
        "taken without running the learned drafter; None: compare goodputs.",
    )
    prior_acceptance: float = Field(
        0.3, ge=0.0, le=1.0, description="Learned per-token acceptance before any is observed."
    )
    acceptance_ema: float = Field(
        0.05, gt=0.0, le=1.0, description="EMA weight of each observed learned step."
    )
    prior_steps: float | None = Field(
        2.0, gt=0.0, description="The prior acceptance is worth this many observed learned steps: "
        "the first observations are averaged with it, so a learned drafter that accepts nothing "
        "is written off in a few drafts, not the ~1 / acceptance_ema an EMA takes (on held-out "
        "ShareGPT a day-0 drafter accepting ~3 % kept drafting at ~0.2 target steps a token). "
        "None: a plain EMA from the prior.",
    )
    target_step_ms: float = Field(
        37.6, gt=0.0, description="Verify cost prior (SmolLM2-135M, bf16, 2 cores)."
    )
    draft_ms_per_step: float = Field(
        2.6, ge=0.0, description="Learned draft cost prior per drafted token."
    )
    measure_verify: bool = Field(
        True, description="Measure verify time between propose and on_verified."
    )
    explore: float = Field(
        0.02, ge=0.0, le=1.0, description="Fraction of rows the learned drafter drafts anyway "
        "(at most: see explore_budget)."
    )
    explore_budget: float = Field(
        0.005, gt=0.0, le=1.0, description="Share of serving time exploration may cost: the "
        "explored fraction is cut so that the learned calls it makes (measured per row, catch-up "
        "of the tokens committed since the row's last draft included) cost at most this share "
        "of the steps. A day-0 learned drafter explored at 2 % of the rows cost ~16 ms a call on "
        "this CPU, ~2 % of serving for 11 accepted tokens in 1500 steps.",
    )
    seed: int = 0


def expected_accepted(confidence: torch.Tensor, lengths: torch.Tensor,
                      parents: torch.Tensor | None = None) -> torch.Tensor:
    """[B, k] per-node confidences, [B] lengths -> [B] expected accepted drafts: the sum over the
    drafted nodes of the product of the confidences on each node's path (chains when ``parents``,
    [B, k] draft-index parents with -1 for the root's children, is None)."""
    k = confidence.shape[1]
    live = torch.arange(k)[None, :] < lengths[:, None]  # [B, k]
    conf = confidence.float().clamp(0, 1) * live  # [B, k]
    if parents is None:
        return torch.cumprod(conf, dim=1).sum(1)  # [B]
    node_parents = torch.cat([torch.full((conf.shape[0], 1), -1), parents.long() + 1], dim=1)  # [B, k+1]
    return torch.from_numpy(path_confidence(node_parents.numpy(), conf.numpy())).float().sum(1)  # [B]


class HybridDrafter:
    kind = "hybrid"
    mixes_sources = True
    """Its drafts are the suffix index's or the learned drafter's (serving's policy: BatchState)."""

    def __init__(self, suffix: Drafter, learned: Drafter, policy: HybridPolicy | None = None,
                 predecessor: Drafter | None = None):
        """``predecessor``: the drafter this one replaces at a swap, a hybrid or the suffix drafter
        a day-0 hybrid is (its suffix index is usually ``suffix`` too); a promoted learned half's
        estimate starts from a predecessor hybrid's live one (``AcceptanceEstimate.successor``)
        where both are known."""
        self.suffix = suffix
        self.learned = learned
        self.policy = policy or HybridPolicy()
        self.version = learned.version
        self.prior_relative = 1.0 if predecessor is not None else None
        """For serving's policy, whose estimate covers the hybrid's drafts as a whole (mostly the
        suffix index's, which a swap of the learned half keeps): a successor goes on from it. A
        first promotion that started serving's estimate afresh (0.5, one step of evidence, a new
        calibration) turned speculation off for ~400 steps in a demo (`spec_off_fraction`
        0.96-0.985 after the swap, 0.07 before), where swaps between hybrids kept drafting."""
        self.feature_layers = tuple(learned.feature_layers)
        self.costs = CostModel(
            target_step_ms=self.policy.target_step_ms,
            draft_ms_per_token=self.policy.draft_ms_per_step,
        )
        measured = getattr(learned, "prior_acceptance", None)  # what its artifact was promoted with
        before = getattr(predecessor, "acceptance", None)
        inherited = before.successor(getattr(learned, "prior_relative", None)) if before is not None else None
        self.acceptance = inherited or AcceptanceEstimate(
            value=self.policy.prior_acceptance if measured is None else measured,
            ema=self.policy.acceptance_ema, prior_weight=self.policy.prior_steps,
        )
        self._rng = np.random.default_rng(self.policy.seed)
        self._learned: dict[str, tuple[list[int], list[int] | None]] = {}
        """request -> its learned proposal this step (tokens, and parents for a tree)."""
        self._proposed_at: float | None = None
        self._proposed_k = 0
        self.last_choice: np.ndarray = np.zeros(0, dtype=np.uint8)
        self._row_ms: float | None = None
        """EMA of a learned call's milliseconds per row drafted (``explore_fraction``)."""
        self._cut_streak = 0
        """Steps in a row whose learned drafts the engine cut to nothing (``on_cut``)."""
        self._sit_out = 0
        """Steps left in which the learned drafter is not called (after cuts: 1, 3, 7, ...)."""

    # -- protocol -----------------------------------------------------------------------------

    def add_request(self, view: DraftRequestView, features: torch.Tensor | None = None) -> None:
        self.suffix.add_request(view, None)
        self.learned.add_request(view, features)

    def on_verified(
        self, request_id: str, accepted_ids: list[int], features: torch.Tensor | None
    ) -> None:
        if self._proposed_at is not None and self.policy.measure_verify:
            self.costs.observe_verify(
                self._proposed_k, (time.perf_counter() - self._proposed_at) * 1e3
            )
        self._proposed_at = None
        drafted = self._learned.pop(request_id, None)
        if drafted is not None:
            tried, accepted = tree_trial(*drafted, list(accepted_ids))
            self.acceptance.observe(np.array([tried]), np.array([accepted]))
        self.suffix.on_verified(request_id, accepted_ids, None)
        self.learned.on_verified(request_id, accepted_ids, features)

    def on_cut(self, kept: dict[str, int]) -> None:
        """The engine verifies only the first ``kept[request]`` nodes of a row's draft (its
        widths: serving/engine/torch_engine.py ``_tell_cut``). A learned draft's trials are what
        was verified: a cut one keeps its verified prefix (nodes are best-first, so a prefix is a
        subtree), and one cut to nothing was no trial. Counted as proposed, every cut draft was a
        refusal, and near break-even, where the policy cuts most, the estimate sank below what the
        verified drafts earned. After a step whose learned drafts were all cut to nothing the
        learned drafter sits out 1, 3, 7, ... steps (``propose``), so that drafts nobody verifies
        are not paid for at every step."""
        cut = verified = False
        for request_id, n in kept.items():
            drafted = self._learned.get(request_id)
            if drafted is None:
                continue
            verified |= n > 0
            if n >= len(drafted[0]):
                continue
            if n <= 0:
                cut = True
                del self._learned[request_id]
            else:
                tokens, parents = drafted
                self._learned[request_id] = (tokens[:n], None if parents is None else parents[:n])
        # A cut moves no estimate, so the drafter would be asked (and paid) again at once: as the
        # engine's policy does for a costly drafter, it sits out 1, 3, 7, ... steps after drafts
        # cut to nothing, until one of its drafts is verified again.
        if verified:
            self._cut_streak = 0
        elif cut:
            self._cut_streak += 1
            self._sit_out = sit_out_after(self._cut_streak, _MOST_SIT_OUT)

    def indexed_tenants(self) -> list[str]:
        return self.suffix.indexed_tenants()

    def forget_tenant(self, tenant: str) -> bool:
        """A data deletion request: the learned part keeps nothing per tenant; the suffix index does."""
        return self.suffix.forget_tenant(tenant)

    def remove_request(self, request_id: str, output_ids: list[int] | None) -> None:
        self._learned.pop(request_id, None)
        self.suffix.remove_request(request_id, output_ids)
        self.learned.remove_request(request_id, output_ids)

    def propose(self, views: list[DraftRequestView], k: int) -> DraftProposal:
        t0 = time.perf_counter()
        batch = len(views)
        if k <= 0 or batch == 0:
            return DraftProposal.empty(batch, max(k, 0))
        sp = _pad(self.suffix.propose(views, k), k)
        conf = sp.confidence if sp.confidence is not None else torch.zeros(batch, k)
        e_suffix = expected_accepted(conf, sp.lengths, sp.parents)  # [B]
        g_none = 1.0 / self.costs.verify_ms(0)
        g_suffix = torch.tensor(
            [suffix_goodput(float(e), int(n), self.costs) for e, n in zip(e_suffix, sp.lengths)]
        )
        # The learned drafter drafts only as far as pays at its live acceptance (best_k): where
        # verifying costs much more per extra token (a CPU), a mediocre drafter still earns with
        # one or two tokens and would lose with k.
        k_learned = self.learned_length(k)
        g_learned = self.learned_prior_goodput(k_learned, k)
        lengths = [int(n) for n in sp.lengths]
        if self.policy.suffix_threshold is not None:
            confident = e_suffix >= self.policy.suffix_threshold
            ask = ~confident & (g_learned > g_suffix) & (g_learned > g_none)
        else:  # the rule the trainer's gate simulates (feedback/goodput.py)
            confident = torch.tensor([suffix_preferred(n, float(g), g_learned)
                                      for n, g in zip(lengths, g_suffix)], dtype=torch.bool)
            ask = torch.tensor([hybrid_choice(n, float(g), g_learned, g_none) == "learned"
                                for n, g in zip(lengths, g_suffix)], dtype=torch.bool)
        candidates = ~confident & ~ask
        explore = torch.from_numpy(
            self._rng.random(batch) < self.explore_fraction(int(candidates.sum()))
        )
        need = (ask | (candidates & explore)).nonzero().flatten().tolist()
        if self._sit_out > 0:  # its last drafts were cut unverified: it sits this step out
            self._sit_out -= 1
            need = []

        out = sp
        use_suffix = (sp.lengths > 0) & (g_suffix > g_none)  # [B]
        out.lengths = torch.where(use_suffix, sp.lengths, torch.zeros_like(sp.lengths))
        out.source = np.where(use_suffix.numpy(), sp.source, np.uint8(DrafterKind.NONE)).astype(
            np.uint8
        )
        out.confidence = conf.clone()
        if need:
            lp = _pad(self.learned.propose([views[i] for i in need], max(k_learned, 1)), k)
            # rows come back from suffix steps with backlogs: committing them is this call's cost
            self.costs.observe_draft(max(k_learned, 1), lp.draft_ms)
            row_ms = lp.draft_ms / len(need)
            self._row_ms = row_ms if self._row_ms is None else 0.8 * self._row_ms + 0.2 * row_ms
            e_learned = expected_accepted(
                lp.confidence if lp.confidence is not None else lp.probs, lp.lengths, lp.parents
            )
            take = []
            for j, i in enumerate(need):
                g_post = (1 + float(e_learned[j])) / self.costs.verify_ms(int(lp.lengths[j]))
                if lp.lengths[j] > 0 and g_post >= max(
                    float(g_suffix[i]) if use_suffix[i] else 0.0, g_none
                ):
                    take.append((i, j))
            out = self._merge(out, lp, take)
        for i, v in enumerate(views):
            n = int(out.lengths[i])
            if out.source[i] == self._learned_source() and n > 0:
                parents = None if out.parents is None else out.parents[i, :n].tolist()
                self._learned[v.request_id] = (out.tokens[i, :n].tolist(), parents)
            else:
                self._learned.pop(v.request_id, None)
        out.tokens[out.lengths == 0] = 0
        out.draft_ms = (time.perf_counter() - t0) * 1e3
        out.catch_up_ms = sp.catch_up_ms + (lp.catch_up_ms if need else 0.0)
        self.last_choice = out.source.copy()
        self._proposed_at = time.perf_counter()
        self._proposed_k = int(out.lengths.max())
        return out

    # -- policy -------------------------------------------------------------------------------

    def explore_fraction(self, candidates: int) -> float:
        """Per-row probability that one of ``candidates`` rows (no confident suffix match, no
        learned draft asked for) gets a learned draft anyway: ``explore``, cut so that the expected
        learned calls cost at most ``explore_budget`` of a step. What a call costs is measured per
        row; it includes committing the tokens verified since the row's last learned draft, so
        rarer exploration makes each call dearer and the fraction settles where the budget holds."""
        if candidates <= 0 or self._row_ms is None or self._row_ms <= 0:
            return self.policy.explore
        affordable = self.policy.explore_budget * self.costs.verify_ms(0) / (self._row_ms * candidates)
        return min(self.policy.explore, affordable)

    def learned_length(self, k: int) -> int:
        """Draft length in 0..k with the best expected goodput at the learned drafter's live
        acceptance and measured costs."""
        return best_k(self.acceptance.value, k, self.costs, self._branches)

    def learned_prior_goodput(self, k: int, k_max: int) -> float:
        """Expected goodput of a learned draft of ``k`` positions, in a step of ``k_max`` nodes."""
        return learned_goodput(self.acceptance.value, k, self.costs, draft_nodes(k, self._branches, k_max))

    @property
    def _branches(self) -> int:
        """Candidates per position of the learned drafter's drafts (1: chains)."""
        return int(getattr(self.learned, "branches", 1))

    def _learned_source(self) -> np.uint8:
        return np.uint8(DrafterKind.parse(self.learned.kind))

    def _merge(
        self, out: DraftProposal, lp: DraftProposal, take: list[tuple[int, int]]
    ) -> DraftProposal:
        if not take:
            return out
        rows = torch.tensor([i for i, _ in take])
        src = torch.tensor([j for _, j in take])
        if lp.dists is not None:
            out = _as_chains(out)  # the learned draft was sampled: rejection sampling verifies chains
            out.dists = _point_masses(out, lp.dists.shape[-1]) if out.dists is None else out.dists
            out.dists[rows] = lp.dists[src]
        if lp.parents is not None:  # learned trees (greedy rows) beside suffix trees or chains
            if out.parents is None:
                out.parents = chain_parents(out.tokens.shape[0], out.k)  # [B, k]
            out.parents[rows] = lp.parents[src]
        elif out.parents is not None:  # learned chains inside a proposal of suffix trees
            out.parents[rows] = chain_parents(len(take), out.k)
        out.tokens[rows] = lp.tokens[src]
        out.lengths[rows] = lp.lengths[src]
        out.probs[rows] = lp.probs[src]
        out.confidence[rows] = (lp.confidence if lp.confidence is not None else lp.probs)[src]
        out.source[rows.numpy()] = lp.source[src.numpy()]
        return out


def _as_chains(p: DraftProposal) -> DraftProposal:
    """A proposal of trees cut to chains: each row keeps its first path (root, then each node's
    first child: the best branch of a best-first tree)."""
    if p.parents is None:
        return p
    par = p.parents.tolist()
    for b in range(p.tokens.shape[0]):
        path, last = [], -1
        for j in range(int(p.lengths[b])):
            if par[b][j] == last:
                path.append(j)
                last = j
        idx = torch.tensor(path + [0] * (p.k - len(path)), dtype=torch.long)
        for name in ("tokens", "probs", "confidence"):
            t = getattr(p, name)
            if t is not None:
                t[b] = t[b, idx]
        p.lengths[b] = len(path)
    p.parents = None
    return p


def _pad(p: DraftProposal, k: int) -> DraftProposal:
    """Make a proposal exactly k wide (drafters may return fewer columns)."""
    if p.k == k:
        return p
    extra = k - p.k
    p.tokens = torch.nn.functional.pad(p.tokens[:, :k], (0, max(extra, 0)))
    p.probs = torch.nn.functional.pad(p.probs[:, :k], (0, max(extra, 0)), value=1.0)
    if p.confidence is not None:
        p.confidence = torch.nn.functional.pad(p.confidence[:, :k], (0, max(extra, 0)))
    if p.dists is not None:
        p.dists = torch.nn.functional.pad(p.dists[:, :k], (0, 0, 0, max(extra, 0)))
    if p.parents is not None:
        chain = chain_parents(p.tokens.shape[0], k)  # padding columns: never drafted
        p.parents = torch.cat([p.parents[:, :k], chain[:, p.parents.shape[1]:]], dim=1)
    p.lengths = p.lengths.clamp(max=k)
    return p


def _point_masses(p: DraftProposal, vocab: int) -> torch.Tensor:
    """[B, k, V] one-hot at each drafted token (what a deterministic draft's q is)."""
    dists = torch.zeros(p.tokens.shape[0], p.tokens.shape[1], vocab)  # [B, k, V]
    dists.scatter_(2, p.tokens[..., None].clamp(0, vocab - 1), 1.0)
    live = torch.arange(p.k)[None, :] < p.lengths[:, None]  # [B, k]
    return dists * live[..., None]
