"""GoodputPolicy: per step, the k in 0..k_max with the highest expected tokens per second.

The goodput model is feedback/goodput.py (``best_k`` over an ``AcceptanceEstimate`` and a
``CostModel``); this class only feeds it from the engine's ``observe`` calls:

- acceptance: every step's drafted/accepted counts (rows that drafted nothing carry no signal);
- draft cost: the batch's draft milliseconds per drafted position (k, not k x rows: the whole batch
  waits for the draft, so the cost per position is what trades against tokens per row);
- verify cost: per verified width (the widest row's drafts, not the k asked for: a drafter that
  found nothing to propose leaves a plain decoding step). Until k = 0 has been measured, the k = 0
  cost is inferred from the measured widths with the CostModel's slope, so the prior of another
  machine cannot make speculation look better or worse than it is here.

k = 0 is sticky (no drafts, so no acceptance evidence), so now and then one step drafts anyway
(``probe_k`` tokens for a costly drafter): probes, spaced to cost at most ``probe_budget`` of
serving time (serving/engine/probes.py). A new drafter (``on_drafter_change``, called by the engine
at a swap) starts from the prior and is probed at the next step that would not draft.

Width (token trees, and chains with per-token confidences): after the draft, ``choose_widths``
cuts each row's proposal to a prefix of its nodes. It takes the batch's nodes most likely to be
accepted first, across rows (``best_nodes_first``: P = the product of the drafter's confidences
along the node's path, times c, an online calibration of accepted / predicted; a costly drafter's
best node in a row, a draft already paid for on its measured acceptance, counts at least that
acceptance, except a hybrid's, whose estimate mixes in the suffix index's), and verifies the
node total n with the highest expected tokens per verify millisecond,
``(B + sum of the first n nodes' P) / verify_ms(n | batch)``. A verify forwards only the real
tokens (B + n; padding is skipped), so what it costs is a matter of n, not of how the nodes split
over the rows: at batch 8 three confident rows may draft while five do not, where one width for
every row had to pay for eight. Verify costs are measured per (batch size, node total) as robust
medians (verify_costs.py: a plain step's median, and each total's ratio to it): a total that pays
at batch 1 may not at batch 8, and n = 0 (plain decoding) wins where nothing pays. A drafter whose
draft's cost hardly grows with its length (the suffix index's lookup;
``CostModel.draft_ms_marginal``) is asked for the full budget every step and the width decides,
its draft charged there; a costly drafter gets k from the acceptance estimate, and after a draft
of its was cut to nothing it sits out 1, 3, 7, ... steps (a cut draft moves no estimate). Either
way, once ``probe_every`` drafts in a row were cut to nothing, it drafts only on probes (a probe verifies
the best non-empty width, so that the calibration keeps learning) until one pays again; probes
are spaced to cost at most ``probe_budget`` (``probe_interval`` for a costly drafter,
``cheap_probe_interval`` at the batch size for a cheap one, whose verify is what costs).
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from feedback.goodput import LIVE_EVIDENCE_STEPS, AcceptanceEstimate, CostModel, best_k
from serving.engine.calibration import ConfidenceCalibration
from serving.engine.policy import BatchState
from serving.engine.probes import ProbeSchedule, sit_out_after
from serving.engine.realized_rates import RealizedRates
from serving.engine.tree import best_nodes_first, node_totals, path_confidence
from serving.engine.verify_costs import VerifyCosts

_WIDTH_MARGIN = 0.04
"""How much more a non-empty width's expected tokens per verify ms must be than plain
decoding's. The width is the argmax of estimates (calibrated confidences over measured costs), and
an argmax over noisy estimates picks the overestimated ones: at batch 8 with bf16 panels, where a
verify of 9 tokens costs ~1.12 plain steps, widths chosen at a predicted 1-3 % gain lost (the
calibration read 0.78-0.87 there), and speculation ran at 0.90-0.94 of plain decoding."""

_PROBE_BUDGET = 0.01
"""The share of serving time probes of a drafter that does not pay may cost. Issue 12's bar is 3 %
over a whole stream for every drafter kind, and a learned kind also pays for its trainer beside
serving on the memory bus (`bench interference`: 0.9-2.5 %); at 2 % the probes alone took two
thirds of the bar. A new drafter is still probed at once (``on_drafter_change``)."""

_ACCEPTANCE_EMA = 0.02
"""EMA weight of one drafting step in the acceptance estimate (~100 outcomes). At 0.05 (~40) a
one-token draft's estimate swung by +-0.08 around a true 0.4, and with break-even at ~0.3 on a
2-core CPU its dips turned a drafter that paid off (ARCHITECTURE.md, "A learned drafter near
break-even"). The cost: after a shift to drafts that do not pay, ~80 more steps drafting."""

_IDLE_DECAY = 0.98
"""Per step that drafted nothing, what the acceptance estimate knows is worth this much less
(``AcceptanceEstimate.idle_decay``): a drafter that is off is observed on probes alone, ~100 steps
apart here, while the requests move on, and as one EMA step each they brought it back only after
many probes. A probe after a gap of G steps weighs 1 / (1 + 49 x 0.98^G): ~0.3 after 100."""

_VERSIONS_KEPT = 8
"""Swapped-out versions whose live acceptance estimate is kept for a rollback to resume from."""

_CHEAP_DRAFT = 0.05
"""A drafter whose full budget of tokens adds under this fraction of a target step to its draft
(``CostModel.draft_ms_marginal``: what one more token adds, not the draft's ms per token) is asked
for the full budget every step, and what its draft costs per step whatever the length is charged
to the width instead (``choose_widths``). A suffix index's lookup on a 2-core EPYC (Zen 4): ~0.47
ms a draft + ~0.02 ms a token against a 10 ms step, so 8 tokens add ~1.6 % of a step (the fit's
noise: 0.2-3.6 %); a learned drafter's token is a forward, 3-14 % of a step each."""


def _fresh_estimate(prior: float | None = None) -> AcceptanceEstimate:
    """The policy's estimate of a drafter without live evidence: at ``prior`` (else the default
    0.5), worth one step of evidence."""
    start = {} if prior is None else {"value": float(prior)}
    return AcceptanceEstimate(prior_weight=1.0, ema=_ACCEPTANCE_EMA, idle_decay=_IDLE_DECAY, **start)


class GoodputPolicy:
    def __init__(
        self,
        k_max: int,
        *,
        probe_every: int = 16,
        probe_k: int | None = None,
        probe_budget: float = _PROBE_BUDGET,
        acceptance: AcceptanceEstimate | None = None,
        costs: CostModel | None = None,
        remeasure_every: int = 64,
    ):
        if k_max < 0:
            raise ValueError(f"k_max must be >= 0, got {k_max}")
        self.k_max = k_max
        # A probe verifies at most a node per row (``choose_widths``), so a costly drafter's probe
        # drafts one position: at 2, the second was drafted at every probe and never verified
        # (~1.3 ms of a ~8 ms probe for a day-0 standalone drafter on a 2-core EPYC).
        self.probe = ProbeSchedule(probe_every, min(k_max, probe_k if probe_k is not None else 1),
                                   probe_budget)
        self.acceptance = acceptance or _fresh_estimate()
        self.costs = costs or CostModel()
        self.chosen: list[int] = []
        """Recent choices (bounded), for benchmarks and debugging."""
        self._k0_measured = False
        self.calibration = ConfidenceCalibration()
        """Accepted / predicted (confidence-based) tokens: scales the drafter's confidences."""
        self.widths: list[int] = []
        """Recent node totals chosen by ``choose_widths`` (bounded)."""
        self.verify = VerifyCosts()
        """Measured verify costs per (batch size, node total): robust medians (verify_costs.py)."""
        self._predicted: float | None = None
        self.zero_widths = 0
        """Consecutive drafts that ``choose_widths`` cut to nothing."""
        self._cheap = True
        """The last ``choose_k`` found the draft cheap (the suffix index) rather than costly."""
        self._short_drafts: float | None = None
        """Share of recent drafts that came back shorter than asked (an EMA; None before the
        first). Such a drafter's lengths vary of themselves (the suffix index drafts what it
        matched), so a cheap one stays cheap until they have drawn ``CostModel.draft_ms_marginal``'s
        line. Judged on its price per token, which carries the lookup's fixed cost, the index was
        found costly on its first drafts in a `bench spec` chat phase (0.7 ms each where later ones
        took 0.5), asked for 1-3 tokens, and with lengths that then hardly varied stayed costly for
        the first ~150 of the phase's ~500 steps (0.3-0.9 nodes a step against 3.2-4.1 after). A
        learned drafter drafts as many tokens as it is asked for."""
        self._floor_paid = False
        """The last draft was a costly drafter's own (no hybrid's): each row's best node counts at
        least its acceptance estimate in ``choose_widths``."""
        self._backoff = 0
        """Plain steps a costly drafter sits out after its draft was cut to nothing (doubling
        with each cut in a row: ``_backoff_after``)."""
        self._since_plain: dict[int, int] = {}  # batch size -> choices since the last n = 0
        self._version: str | None = None
        """The installed drafter's version, as ``on_drafter_change`` was told."""
        self._left: dict[str, AcceptanceEstimate] = {}
        """version -> its estimate when it was swapped out (the last ``_VERSIONS_KEPT``): where a
        rollback resumes."""
        self.remeasure_every = remeasure_every
        self._draft_ms: dict[int, float] = {}
        """batch size -> EMA of a drafting step's draft milliseconds (see ``choose_widths``)."""
        self._probed = False
        """The last ``choose_widths`` was a probe's."""
        self.cuts: Counter[str] = Counter()
        """Why steps went plain where the drafter would have drafted (benchmarks, debugging):
        "remeasure" (a plain step to keep its cost measured: in ``choose_k``, before the draft,
        or in ``choose_widths`` for the first steps at a batch size), "predicted" (no width
        predicted to pay), "outcomes" (``drafting_loses``), "backoff" (a costly drafter sitting
        out steps after its drafts were cut, in ``choose_k``: ``_backoff_after``). A probe, which
        verifies a draft whatever was predicted, is no cut."""
        self.realized = RealizedRates()
        """What the steps that verified drafts delivered, per batch size (``drafting_loses``)."""

    @property
    def probe_every(self) -> int:
        return self.probe.every

    @property
    def probe_k(self) -> int:
        return self.probe.k

    @property
    def probes(self) -> int:
        return self.probe.count

    def choose_k(self, state: BatchState) -> int:
        k_max = min(self.k_max, state.k_max)
        if k_max <= 0:
            self._remember(0)
            return 0
        cheap = self.costs.draft_ms_marginal * k_max < _CHEAP_DRAFT * self.costs.verify_ms(0)
        if (not cheap and self._cheap and (self._short_drafts or 0.0) >= 0.5
                and not self.costs.draft_line_fitted):
            cheap = True  # see ``_short_drafts``
        self._cheap = cheap
        # The estimate is the drafter's own acceptance unless a hybrid mixes the suffix index's
        # drafts into it: then it says nothing of a learned draft's best node (``choose_widths``).
        self._floor_paid = not cheap and not state.mixed_sources
        if not cheap and self._backoff > 0 and not self.probe.for_new_drafter:
            # a costly draft was cut to nothing: the next one waits (see ``_backoff_after``),
            # decided before ``best_k``, whose ~40 us were most of a step's policy time at batch 8
            self._backoff -= 1
            self.cuts["backoff"] += 1
            self._remember(0)
            return 0
        # A cheap draft (the suffix index) asks for the full budget and the width decides; a
        # costly one asks for what its acceptance pays for at the batch-agnostic costs.
        k = k_max if cheap else best_k(self.acceptance.value, k_max, self.costs, state.branches)
        batch = state.batch_size
        if k > 0 and (self.zero_widths >= self.probe_every or self.drafting_loses(batch)):
            # ...but the width step (verify costs measured at this batch size) kept cutting the
            # drafts to nothing, or drafting steps at this batch size delivered less than plain
            # ones: draft only on probes until one pays again, so that a draft that is thrown
            # away is not paid for every step (at batch 8 the suffix index's ~1 ms per drafted
            # position was 3-9 % of a step, every step).
            return self._probe_or_plain(k if cheap else min(k, max(1, self.probe_k)),
                                        costly=not cheap, batch=batch)
        if k == 0:
            return self._probe_or_plain(max(1, self.probe_k), costly=True, batch=batch)
        if self._since_plain.get(batch, 0) >= self.remeasure_every:
            # a plain step to keep its cost at this batch size measured (choose_widths counts
            # the steps since one): decided before the draft, which it would throw away
            self.cuts["remeasure"] += 1
            self._remember(0)
            return 0
        self.probe.off_streak = 0
        self._remember(k)
        return k

    def _probe_or_plain(self, k: int, costly: bool, batch: int) -> int:
        """k = 0, except when a probe is due (``probe_interval`` steps apart for a costly drafter,
        ``cheap_probe_interval`` for a cheap one, at once after ``on_drafter_change``): then a
        probe of ``k`` drafts, whose width ``choose_widths`` keeps non-empty so that the estimates
        keep learning."""
        interval = self.probe_interval() if costly else self.cheap_probe_interval(batch)
        k = k if self.probe.due(interval, costly) else 0
        self._remember(k)
        return k

    def probe_interval(self) -> int:
        """Steps between probes of a costly drafter that does not pay (``ProbeSchedule``)."""
        return self.probe.costly_interval(self.costs)

    def cheap_probe_interval(self, batch: int) -> int:
        """Steps between probes of a cheap drafter at this batch size (``ProbeSchedule``)."""
        plain = self.verify_ms(0, batch)
        extra = (self.verify_ms(batch, batch) + self._draft_ms.get(batch, 0.0)) / plain - 1.0
        return self.probe.cheap_interval(extra)

    def on_drafter_change(self, prior_acceptance: float | None = None, *, version: str | None = None,
                          relative: float | None = None) -> None:
        """A new drafter is installed: what was learned of the old one's acceptance no longer
        holds as it was. The estimate starts, in this order, where ``version`` left it when it
        was live before (a rollback), at the outgoing drafter's live estimate times ``relative``
        (a promoted successor: ``AcceptanceEstimate.successor``), or at ``prior_acceptance`` (the
        held-out acceptance its artifact records; else the default prior, 0.5); a probe comes at
        the next step that would not draft. (Draft costs are kept: they are re-measured at every
        draft.) A day-0 selfspec drafter's drafts were cut to nothing by the width step at the
        0.5 prior, which no cut draft moves, so it went on drafting one token at ~0.25 of a step
        on its back-off schedule; its artifact said 0.31."""
        if self._version is not None and self.acceptance.steps >= LIVE_EVIDENCE_STEPS:
            self._left[self._version] = self.acceptance
            while len(self._left) > _VERSIONS_KEPT:
                self._left.pop(next(iter(self._left)))
        inherited = self._left.pop(version, None) if version is not None else None
        inherited = inherited or self.acceptance.successor(relative)
        if inherited is not None:
            self.acceptance = inherited  # the calibration of its confidences carries over too
        else:
            self.acceptance = _fresh_estimate(prior_acceptance)
            self.calibration = ConfidenceCalibration()
        self._version = version
        self.zero_widths = 0
        self._backoff = 0
        self.probe.restart()

    def verify_ms(self, nodes: int, batch: int) -> float:
        """Verify milliseconds of ``nodes`` drafted tokens in all at this batch size: measured, else
        priced from what is (``VerifyCosts.price``), else the prior."""
        return self.verify.price(batch, nodes, self.costs.verify_ms(0), self.costs.verify_slope)

    def choose_widths(self, parents, confidence, lengths, batch: int) -> np.ndarray:
        """Per row, how many of its drafted nodes to verify this step ([B] ints; see the module
        docstring): the nodes most likely to be accepted across the whole batch, as many in all
        as pay for the verify they widen."""
        conf = confidence.numpy() if hasattr(confidence, "numpy") else np.asarray(confidence)
        par = parents.numpy() if hasattr(parents, "numpy") else np.asarray(parents)
        k = conf.shape[1]
        # Over Python lists from here: a few dozen values, where each numpy call costs ~10 us on
        # the step thread's cold caches (this step took ~0.19 ms a step at batch 1 in numpy ops).
        lens = [min(int(n), k) for n in (lengths.tolist() if hasattr(lengths, "tolist") else lengths)]  # [B]
        scale = self.calibration.value
        cum = [[p * scale for p in row] for row in path_confidence(par, conf).tolist()]  # [B, K]
        worth = cum
        if self._floor_paid:
            # A costly draft is paid, and ``choose_k`` paid for it on this drafter's measured
            # acceptance: each row's best node is worth at least that. Its calibrated confidence
            # alone cut a selfspec drafter's drafts that were then accepted 0.33 of the time
            # (HumanEval 40-55: 123 of 452 drafts cut, 288 ms of drafts thrown away), and the
            # estimate, which saw only the drafts it kept, overstated the drafts it would pay for.
            floor = self.acceptance.value
            worth = [[max(row[0], floor)] + row[1:] if n > 0 else row for row, n in zip(cum, lens)]
        rows, gains = best_nodes_first(worth, lens)  # [N], [N]
        expected = [float(batch)]  # [N+1] by node total
        for g in gains:
            expected.append(expected[-1] + g)
        stated = gains  # what the calibrated confidences say of each node: what calibration learns
        if worth is not cum:
            stated = list(gains)
            firsts: set[int] = set()
            for i, r in enumerate(rows):  # each row's best node, floored above
                if r not in firsts:
                    firsts.add(r)
                    stated[i] = cum[r][0]
        totals = node_totals(len(rows))
        # A non-empty width also pays for the draft: this step's is spent, but widths that do not
        # cover it are cut to nothing, and after ``probe_every`` of those the drafter is asked
        # only on probes (at batch 8 the suffix index took ~1.9 ms a step, ~7 % of one).
        # A costly drafter's draft (a learned model's forwards) is priced where it is decided, in
        # ``choose_k`` (its acceptance, its measured cost); here it is spent whatever the width,
        # so the width is the one that makes the most of it: cutting a one-token selfspec tree
        # that promised 0.4 tokens for a 0.1-step wider verify threw its 0.25-step draft away on
        # two drafts in three (`bench spec --drafter selfspec`, HumanEval: 0.96x).
        draft = self._draft_ms.get(batch, 0.0) if self._cheap else 0.0
        rates = [expected[n] / (self.verify_ms(n, batch) + (draft if n else 0.0)) for n in totals]
        rates[0] *= 1.0 + _WIDTH_MARGIN  # a width must beat plain decoding by the margin
        pick = max(range(len(rates)), key=rates.__getitem__)  # the first best, as np.argmax
        cut = "predicted"  # why the width is empty, if it ends up so
        if totals[pick] > 0 and self.drafting_loses(batch):
            pick = 0  # predicted to pay, but drafting steps at this batch size did not: off, probes
            cut = "outcomes"
        self.zero_widths = self.zero_widths + 1 if totals[pick] == 0 else 0
        if self.probe.now and len(totals) > 1:  # a probe verifies the best non-empty total,
            cap = max(1, batch)  # at most a node per row, whatever it costs
            capped = [r if n <= cap else -1.0 for n, r in zip(totals[1:], rates[1:])]
            pick = 1 + max(range(len(capped)), key=capped.__getitem__)
        probing, self.probe.now = self.probe.now, False
        self._probed = probing
        since = self._since_plain.get(batch, self.remeasure_every)
        if totals[pick] > 0 and since >= self.remeasure_every and not probing:
            pick = 0  # keep the plain step's cost at this batch size measured, now and then
            cut = "remeasure"
        nodes = totals[pick]
        self._backoff = self._backoff_after(self.zero_widths) if nodes == 0 else 0
        if nodes == 0 and len(totals) > 1:  # the drafter drafted; nothing of it is verified
            self.cuts[cut] += 1
        self._since_plain[batch] = 0 if nodes == 0 else since + 1
        self._predicted = float(sum(stated[:nodes]))
        self.widths.append(nodes)
        if len(self.widths) > 4096:
            del self.widths[:2048]
        widths = [0] * len(lens)
        for r in rows[:nodes]:
            widths[r] += 1
        return np.array(widths, dtype=np.int64)

    def _backoff_after(self, cuts: int) -> int:
        """Plain steps before a costly drafter drafts again after ``cuts`` of its drafts in a row
        were cut to nothing: 1, 3, 7, ... up to the probe interval. A cut draft is paid in full
        and brings no acceptance evidence (nothing of it is verified), so the acceptance estimate
        that asked for it does not move: a day-0 standalone drafter at its prior of 0.5 drafted
        31 times on 16 MT-Bench + HumanEval requests that all ended cut (421 of its 704 ms of
        drafts). A cheap drafter (the suffix index) drafts every step; after ``probe_every``
        cuts in a row either kind drafts only on probes."""
        return 0 if self._cheap else sit_out_after(cuts, self.probe_interval())

    def drafting_loses(self, batch: int) -> bool:
        """Whether, at this batch size, the steps that verified drafts delivered fewer tokens per
        millisecond (their draft included) than a plain step does (realized_rates.py). Probes keep
        the drafting rate measured. Not at batch 1: there the rate follows one request at a time,
        and after chat requests it held drafting off into the first code request of a day-0 suffix
        index (`bench spec --warm 12`, day-0 code 1.57x and 1.34x with it, 1.87x without)."""
        if batch < 2:  # one request's steps: its own confidences decide (see the docstring)
            return False
        return self.realized.below(batch, self.verify.measured(batch).get(0))

    def observe(
        self, k, num_drafted, num_accepted, draft_ms, verify_ms, width=None, batch=None,
        nodes=None, proposed=None, catch_up_ms=0.0,
    ) -> None:
        """One verify step: ``width`` its widest row's drafts, ``nodes`` the drafts verified in
        all (default: ``width`` for every row), ``proposed`` the widest row's drafts before the
        width step cut them (default: ``width``), which is what ``draft_ms`` paid for, and
        ``catch_up_ms`` the part of ``draft_ms`` that committed backlogs of rows that had not
        drafted (DraftProposal.catch_up_ms): on a probe it is the probe's cost, not drafting's."""
        drafted = np.asarray(num_drafted)
        accepted = np.asarray(num_accepted)
        total_accepted = float(sum(accepted.tolist()))  # a few rows: numpy's sum costs more
        self.acceptance.observe(drafted, accepted)
        if batch is not None and width is not None:
            nodes = int(width) * int(batch) if nodes is None else int(nodes)
            if nodes == 0:
                self._since_plain[int(batch)] = 0
            self.verify.observe(int(batch), nodes, float(verify_ms))
            if nodes > 0 and self._predicted is not None:  # a width this policy chose
                self.realized.observe(int(batch), len(accepted) + total_accepted,
                                      float(draft_ms) + float(verify_ms), probe=self._probed)
        predicted, self._predicted = self._predicted, None
        if predicted is not None:
            self.calibration.observe(total_accepted, predicted)
        if width is None:
            width = int(drafted.max()) if drafted.size else 0
        width = int(width)
        probe = self.probe.costly_now
        self.probe.observe_cost(float(draft_ms), float(verify_ms), self.costs.verify_ms(0))
        # A draft's cost is measured whether or not the width step kept any of it: a costly
        # drafter whose drafts were all cut kept the prior's 0.05 ms per token, so ``choose_k``
        # went on asking a day-0 selfspec drafter for 4 tokens at 7-16 ms a draft.
        # The catch-up (committing a backlog: a new request's prompt, the inputs of steps the
        # drafter sat out) is priced apart from the per-token cost. Folded into it, one prompt
        # commit (~18 ms for 64 inputs on 2 cores, against ~2.5 ms for a one-token draft) made the
        # first draft of a run read ~9 ms a token, and a drafter then measured only on probes
        # never drafted again. A probe's catch-up is the probe's cost (``ProbeSchedule.cost_ms``,
        # which spaces the probes); the others are what drafting on and off costs, amortised over
        # the drafts (``CostModel.catch_up_ms_per_draft``).
        steady_ms = max(0.0, float(draft_ms) - float(catch_up_ms))
        paid_for = width if proposed is None else int(proposed)  # positions: a tree has more nodes
        if paid_for > 0 and k > 0:
            short = float(paid_for < k)
            prev = self._short_drafts
            self._short_drafts = short if prev is None else 0.9 * prev + 0.1 * short
        if paid_for > 0:
            self.costs.observe_draft(paid_for, steady_ms)
            if not probe:
                self.costs.observe_catch_up(float(catch_up_ms))
        if batch is not None and steady_ms > 0:
            old = self._draft_ms.get(int(batch))
            self._draft_ms[int(batch)] = steady_ms if old is None else 0.9 * old + 0.1 * steady_ms
        self.costs.observe_verify(width, verify_ms)
        if width == 0:
            self._k0_measured = True
        elif not self._k0_measured:
            # Anchor the k = 0 prior on this machine's measured speed.
            self.costs.target_step_ms = self.costs.verify_ms(width) / (1.0 + self.costs.verify_slope * width)

    def _remember(self, k: int) -> None:
        self.chosen.append(k)
        if len(self.chosen) > 4096:
            del self.chosen[:2048]
