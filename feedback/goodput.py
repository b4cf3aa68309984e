"""Goodput-optimal speculation length (SmartSpec-style).

Per step, pick k in 0..k_max that maximises expected tokens per second:

    goodput(k) = E[tokens emitted | k] / (draft_cost(k) + verify_cost(k))

With a per-token acceptance probability ``a`` (tokens accepted independently given the previous
were), a verify step with k drafts emits ``1 + a + a^2 + ... + a^k = (1 - a^(k+1)) / (1 - a)``
tokens. When the drafter gives per-token confidences c_1..c_k, E = 1 + sum_j prod_{i<=j} c_i.
k = 0 is plain decoding (1 token per target step); it wins when drafting does not pay.

Costs are measured online: an EMA of draft milliseconds per drafted token (and what one more token
adds to a draft, ``CostModel.draft_ms_marginal``) and of verify milliseconds as a function of the
number of verified positions (k+1). Until measured, a prior from
this machine's figures is used (verify 4/8/16 tokens = 0.99/1.09/1.33 x one token).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

LEARNED_BRANCHES = 2
"""Candidates per drafted position of a learned draft: its most likely token and the runner-up,
siblings in a token tree (serving/drafters/draft_tree.py). Serving's learned drafters draft so
(``LearnedDrafter.branches``) and the trainer's gate simulates and charges it
(``GateConfig.branches``). Two, measured: on 2 CPU cores a one-token selfspec draft verified with
its runner-up ran at 1.065x of plain decoding on HumanEval against 1.037x for the chain and 1.025x
for four candidates, whose wider verify cost more than they added (ARCHITECTURE.md, "Learned
drafts branch")."""


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens emitted by one verify step with k drafts at per-token acceptance ``acceptance``."""
    a = min(max(acceptance, 0.0), 0.999999)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def expected_tokens_from_confidence(confidence: np.ndarray) -> np.ndarray:
    """[B, k] per-token confidences -> [B, k+1] expected tokens when drafting 0..k of them."""
    cum = np.cumprod(np.clip(confidence, 0.0, 1.0), axis=1)  # [B, k]
    return 1.0 + np.concatenate([np.zeros((cum.shape[0], 1)), np.cumsum(cum, axis=1)], axis=1)


@dataclass
class CostModel:
    """Online estimates of draft and verify costs in milliseconds."""

    target_step_ms: float = 37.6
    draft_ms_per_token: float = 0.05
    # Relative verify cost per extra verified position, from the measured 0.99/1.09/1.33 curve.
    verify_slope: float = 0.022
    ema: float = 0.1
    catch_up_prior_drafts: float = 16.0
    catch_up_decay: float = 0.98
    _verify_obs: dict[int, float] = field(default_factory=dict)
    _draft_measured: bool = False
    _draft_sums: tuple[float, float, float, float, float] = (0.0, 0.0, 0.0, 0.0, 0.0)
    """EMA-weighted sums over drafts of (1, n, n^2, ms, n ms): the line ``draft_ms_marginal`` fits."""
    _catch_up_sum: float = 0.0
    _catch_up_drafts: float | None = None

    def verify_ms(self, k: int) -> float:
        """A verify of ``k`` drafted tokens: as measured, but never below a plain step (``k`` = 0).
        A forward of more tokens reads the same weights and does more work, so a width measured
        below the plain step says the plain step's figure is stale, not that drafting is free: an
        engine's first plain step is cold (17.7 ms against 12.2 warm on a 2-core EPYC), and a
        learned drafter at ~0.01 acceptance, whose later, warm 4-node verifies read 15 ms, drafted
        every step for its first 40-100 steps, each ~30 % of a step lost."""
        measured = self._verify_obs.get(k)
        if measured is None:
            return self.target_step_ms * (1.0 + self.verify_slope * k)
        plain = self._verify_obs.get(0) if k else None  # a measured one: the prior is no floor
        return measured if plain is None else max(measured, plain)

    def observe_verify(self, k: int, ms: float) -> None:
        prev = self._verify_obs.get(k)
        self._verify_obs[k] = ms if prev is None else (1 - self.ema) * prev + self.ema * ms
        if k == 0:
            self.target_step_ms = self._verify_obs[0]

    def observe_draft(self, num_tokens: int, ms: float) -> None:
        """One draft of ``num_tokens`` positions in ``ms``. The first replaces the prior (a costly
        drafter judged at the prior's 0.05 ms per token for its first ~10 drafts paid for all of
        them); later ones move an EMA, and the line ``draft_ms_marginal`` reads, each counted at
        most ``_DRAFT_SPIKE`` times what a draft of that length has cost (``_spike_cap``)."""
        if num_tokens <= 0:
            return
        n, ms = float(num_tokens), float(ms)
        if not self._draft_measured:
            self.draft_ms_per_token, self._draft_measured = ms / n, True
            self._draft_sums = (1.0, n, n * n, ms, n * ms)
            return
        ms = min(ms, self._spike_cap(n))
        per_token, point = ms / n, (1.0, n, n * n, ms, n * ms)
        self.draft_ms_per_token = (1 - self.ema) * self.draft_ms_per_token + self.ema * per_token
        self._draft_sums = tuple((1 - self.ema) * s + self.ema * x for s, x in zip(self._draft_sums, point))

    def _spike_cap(self, n: float) -> float:
        """The most one draft of ``n`` positions may count for: ``_DRAFT_SPIKE`` times the larger
        of its price per token and a draft's mean (a lookup costs the same for 1 or 8 tokens).

        Why: one spiked draft bent the line. A learned drafter probed after sitting out ran its
        2-token draft cold (13.6 ms with the catch-up taken out, against 2.3-2.8 warm); among its
        few drafts of other lengths (4 tokens in 4.6 ms) that drew the line flat, the drafter read
        as cheap (``draft_ms_marginal`` 0), was asked for its whole budget every step, and drafted
        4 tokens at ~5 ms a step for 16 steps, none accepted, 12 of them cut to nothing by the width
        step (`bench online --drafter standalone`, day 0). A real rise in price still moves the EMA, by up to
        ``ema`` x (``_DRAFT_SPIKE`` - 1) of it a draft (10 %)."""
        w, _, _, sms, _ = self._draft_sums
        return _DRAFT_SPIKE * max(self.draft_ms_per_token * n, sms / w)

    @property
    def draft_ms_marginal(self) -> float:
        """What one more drafted token adds to a draft's milliseconds: the slope of the line
        ms = a + b n through the drafts (least squares, the same EMA weights), kept within [0, ms
        per token]; ``draft_ms_per_token`` where the lengths hardly vary (a learned drafter asked
        for one token each time) and the line is not determined.

        Why a slope beside the price per token: a suffix index's draft is a lookup that costs
        about the same for 2 or 8 tokens (~0.47 ms + ~0.02 ms a token on a 2-core EPYC, a 10 ms
        step). Per token, 8 tokens looked like ~1-2 ms and the policy asked for 3-4 (GoodputPolicy's
        ``_CHEAP_DRAFT``): its trees were verified at half the size the index offered (HumanEval:
        1.87-1.98x at 2.4-2.6 tokens per verify, against 2.25-2.27x at 2.9-3.2 for full trees;
        ARCHITECTURE.md, forty-third session). A learned drafter's draft is still priced per token
        (``draft_ms``): its k is chosen on it, and a line through one- and two-token drafts is a noisy
        thing to choose k on (priced on it, two held-out runs read day-0 speedups of 0.93 where
        two priced per token read 0.99)."""
        spread = self._length_spread()
        if spread < _MIN_LENGTH_SPREAD:
            return self.draft_ms_per_token
        w, sn, _, sms, snms = self._draft_sums
        mean_n, mean_ms = sn / w, sms / w
        # kept >= 0: a hybrid's learned drafts, fewer tokens at more ms than its suffix drafts,
        # tilt the line below 0
        return min(max((snms / w - mean_n * mean_ms) / spread, 0.0), mean_ms / mean_n)

    @property
    def draft_line_fitted(self) -> bool:
        """Whether the drafts' lengths varied enough for ``draft_ms_marginal`` to be a line's
        slope rather than the price per token."""
        return self._length_spread() >= _MIN_LENGTH_SPREAD

    def _length_spread(self) -> float:
        """The drafted lengths' variance (tokens^2, the same EMA weights); 0 before any draft."""
        if not self._draft_measured:
            return 0.0
        w, sn, snn, _, _ = self._draft_sums
        mean_n = sn / w
        return snn / w - mean_n * mean_n

    @property
    def catch_up_ms_per_draft(self) -> float:
        """What a learned drafter pays per draft, on average, to commit backlogs (a new request's
        prompt, the inputs of steps it sat out) beyond its per-token price: decayed sums of the
        catch-ups over the drafts (``observe_catch_up``), starting from ``catch_up_prior_drafts``
        drafts that paid none, so that one prompt commit (~18 ms for 64 tokens on a 2-core CPU) is
        spread over a request's drafts rather than priced into every draft token."""
        return self._catch_up_sum / self._catch_up_drafts if self._catch_up_drafts else 0.0

    def observe_catch_up(self, ms: float) -> None:
        """One draft that committed ``ms`` of backlog (0 for most)."""
        drafts = self.catch_up_prior_drafts if self._catch_up_drafts is None else self._catch_up_drafts
        self._catch_up_sum = self.catch_up_decay * self._catch_up_sum + max(0.0, float(ms))
        self._catch_up_drafts = self.catch_up_decay * drafts + 1.0

    def draft_ms(self, k: int) -> float:
        """What a learned draft of ``k`` positions costs: its tokens and, amortised, its catch-ups."""
        return k * self.draft_ms_per_token + (self.catch_up_ms_per_draft if k > 0 else 0.0)


_DRAFT_SPIKE = 2.0
"""A draft counts in ``CostModel``'s draft prices for at most this many times what one of its
length has cost (``CostModel._spike_cap``)."""

_MIN_LENGTH_SPREAD = 0.25
"""Variance of the drafted lengths (tokens^2) below which ``CostModel.draft_ms_marginal`` fits no
slope."""


def learned_goodput(acceptance: float, k: int, costs: CostModel, nodes: int | None = None) -> float:
    """Expected tokens per unit cost of a learned draft of ``k`` positions at per-position
    ``acceptance``: its draft time (``CostModel.draft_ms``) plus the verify of its ``nodes``
    (default k; a tree with runners-up beside each position has more)."""
    n = k if nodes is None else nodes
    return expected_tokens(acceptance, k) / (costs.draft_ms(k) + costs.verify_ms(n))


def suffix_goodput(expected_accepted: float, k: int, costs: CostModel) -> float:
    """Expected tokens per unit cost of a model-free draft of ``k`` tokens (drafting is free)
    expected to have ``expected_accepted`` of them accepted."""
    return (1.0 + expected_accepted) / costs.verify_ms(k)


def draft_nodes(k: int, branches: int, k_max: int) -> int:
    """Nodes a learned draft of ``k`` positions with ``branches`` candidates each verifies, at most
    the ``k_max`` a step verifies."""
    return min(k * branches, max(k_max, k))


def best_k(acceptance: float, k_max: int, costs: CostModel, branches: int = 1) -> int:
    """k in 0..k_max with the highest expected goodput (``branches``: candidates per position)."""
    return int(np.argmax([learned_goodput(acceptance, k, costs, draft_nodes(k, branches, k_max))
                          for k in range(k_max + 1)]))


def suffix_preferred(suffix_len: int, g_suffix: float, g_learned: float) -> bool:
    """The hybrid keeps the suffix draft, without asking the learned drafter, when it has one and
    it promises at least the learned drafter's goodput."""
    return suffix_len > 0 and g_suffix >= g_learned


def hybrid_choice(suffix_len: int, g_suffix: float, g_learned: float, g_none: float) -> str:
    """The hybrid drafter's rule, per request and step: ``"suffix"``, ``"learned"`` or ``"none"``
    (plain decoding). Serving's HybridDrafter drafts by it and the trainer's gate simulates it.

    ``g_*``: expected tokens per unit cost of the suffix draft of ``suffix_len`` tokens, of the
    learned draft (0 without one) and of plain decoding. The learned drafter is asked only where
    the suffix draft is not preferred and it beats both the suffix draft and plain decoding; a
    suffix draft is used only where it beats plain decoding."""
    if not suffix_preferred(suffix_len, g_suffix, g_learned) and g_learned > max(g_suffix, g_none):
        return "learned"
    return "suffix" if suffix_len > 0 and g_suffix > g_none else "none"


LIVE_EVIDENCE_STEPS = 8
"""Observations behind a live acceptance estimate before a drafter swap hands it on (to a promoted
successor, or to a version's return after a rollback) rather than starting from an artifact's figure."""


@dataclass
class AcceptanceEstimate:
    """EMA of the per-token acceptance probability, learned from verify outcomes.

    A step that drafted n tokens and accepted m contributes m successes and (1 if m < n) failure:
    the accept-until-first-reject process is a geometric trial sequence.
    """

    value: float = 0.5
    ema: float = 0.05
    prior_weight: float | None = None
    """When set, ``value`` is a prior worth this many steps: the first observations are averaged
    with it (weight 1 / (prior_weight + n + 1)) until that falls below ``ema``. A new drafter's
    estimate then settles in a few steps instead of the ~1 / ema an EMA from the prior takes (a
    drafter that is judged at 0.5 while it accepts nothing drafts, and costs, all that time)."""
    steps: int = 0

    idle_decay: float = 1.0
    """Per step that drafted nothing, the evidence behind ``value`` is worth this much less (1.0:
    only observations count). A drafter that is off is observed on probes alone, tens of steps
    apart, while what it drafts for (the requests, the domain) moves on: an observation after a
    gap then weighs more than one EMA step (GoodputPolicy: ``_IDLE_DECAY``)."""
    _idle: int = field(default=0, init=False, repr=False)
    """Steps without drafts since the last observation."""

    def observe(self, num_drafted: np.ndarray, num_accepted: np.ndarray) -> None:
        # over Python ints: a step's few rows, where each numpy mask and sum cost ~10-20 us on
        # the engine's step thread (cold caches after the forward)
        successes = failures = 0
        any_drafted = False
        for d, a in zip(np.asarray(num_drafted).tolist(), np.asarray(num_accepted).tolist()):
            if d > 0:
                any_drafted = True
                successes += a
                failures += a < d
        if not any_drafted:
            self._idle += 1  # a step without evidence: what is known ages (``idle_decay``)
            return
        successes, failures = float(successes), float(failures)
        if successes + failures == 0:
            return
        step_rate = successes / (successes + failures)
        weight = self.ema
        if self.prior_weight is not None:
            weight = max(weight, 1.0 / (self.prior_weight + self.steps + 1))
        if self._idle and self.idle_decay < 1.0:  # the evidence behind value (1/weight - 1), aged
            held = (1.0 / weight - 1.0) * self.idle_decay ** self._idle
            weight = 1.0 / (held + 1.0)
        self._idle = 0
        self.steps += 1
        self.value = (1 - weight) * self.value + weight * step_rate

    def successor(self, relative: float | None, min_steps: int = LIVE_EVIDENCE_STEPS) -> AcceptanceEstimate | None:
        """Where a promoted successor's estimate starts: this (its predecessor's live) estimate,
        scaled by ``relative`` = the successor's held-out acceptance over its predecessor's, both
        scored by the trainer's gate on the same held-out traces at the promotion, and worth as
        much evidence as an EMA holds (``1 / ema`` steps). None where that is not known: no
        ``relative``, or fewer than ``min_steps`` observations behind this estimate.

        Why not the successor's own held-out figure: the held-out set mixes the domains served
        so far, so after a shift it lags what the live drafter accepts on the new domain, and a
        policy started there turned the successor off at once: an identical drafter recorded at
        0.2, where ~0.4 was accepted live, ran 1.006 tokens a step for the next 354 steps, and
        the rollback watch rolled such successors back (three promotions of a 200-request
        stream; ARCHITECTURE.md, "A successor starts where its predecessor was live")."""
        if relative is None or self.steps < min_steps or not np.isfinite(relative) or relative <= 0:
            return None
        value = float(np.clip(self.value * relative, 0.0, 0.95))
        return AcceptanceEstimate(value=value, ema=self.ema, prior_weight=1.0 / self.ema,
                                  idle_decay=self.idle_decay)


def held_out_ratio(candidate: float | None, champion: float | None) -> float | None:
    """A promoted drafter's held-out acceptance over its predecessor's (the same traces), or None
    where either is missing or the predecessor's is ~0 (a ratio then says nothing)."""
    if candidate is None or champion is None or champion < 0.01:
        return None
    return float(candidate) / float(champion)
