"""When a drafter the goodput policy has turned off drafts anyway: probes, priced to a budget.

k = 0 is sticky (no drafts, so no acceptance evidence), so now and then one step drafts anyway to
refresh the estimates: a drafter that got better (a suffix index that learned the new domain) is
noticed within a few probes. Probes are spaced so that they cost at most ``budget`` of serving
time, and at least ``every`` steps apart: a costly drafter that does not pay (an untrained learned
drafter on a CPU, ~0.6 of a target step per drafted token) then costs about that much, not a probe
every 16 steps (~9 %). A new drafter is probed at the next step that would not draft.
"""

from __future__ import annotations

import math

from feedback.goodput import CostModel


def sit_out_after(cuts: int, most: int) -> int:
    """Steps a costly drafter waits after ``cuts`` of its drafts in a row were cut to nothing: 1,
    3, 7, ... up to ``most``. A cut draft was paid for and verified nothing, so the estimate that
    asked for it does not move and would ask again at once."""
    return 0 if cuts <= 0 else min((1 << min(cuts, 16)) - 1, most)


class ProbeSchedule:
    """The probe state of one GoodputPolicy (see the module docstring): ``every``, the fewest
    steps between probes; ``k``, a costly drafter's probe length; ``budget``, the share of serving
    time probes may cost."""

    def __init__(self, every: int, k: int, budget: float):
        if every < 1:
            raise ValueError(f"probe_every must be >= 1, got {every}")
        if not 0 < budget <= 1:
            raise ValueError(f"probe_budget must be in (0, 1], got {budget}")
        self.every, self.k, self.budget = every, k, budget
        self.off_streak = 0
        """Consecutive steps decided as k = 0 (a probe resets it)."""
        self.count = 0
        """Probes so far."""
        self.for_new_drafter = False
        """Probe at the next k = 0 decision: a new drafter was installed."""
        self.now = False
        """This step is a probe: the width step verifies a non-empty total."""
        self.costly_now = False
        """This step's probe is a costly drafter's: ``observe_cost`` measures what it cost."""
        self.cost_ms: float | None = None
        """EMA of what a costly drafter's probe cost over a plain step (its draft, catch-up
        included, and the wider verify)."""

    def due(self, interval: int, costly: bool) -> bool:
        """One more step decided as k = 0: whether it is a probe instead (every ``interval``
        steps, or at once for a new drafter)."""
        self.off_streak += 1
        if self.off_streak < interval and not self.for_new_drafter:
            return False
        self.for_new_drafter = False
        self.costly_now = costly
        self.now = True
        self.off_streak = 0
        self.count += 1
        return True

    def costly_interval(self, costs: CostModel) -> int:
        """Steps between probes of a costly drafter that does not pay: at least ``every``, and
        enough that a probe (its draft, and the wider verify) costs at most ``budget`` of the plain
        steps between two probes."""
        k = max(1, self.k)
        step = costs.verify_ms(0)
        cost = self.cost_ms  # measured: a learned drafter's probe also commits the tokens it
        if cost is None:     # skipped (a new request's whole prompt), which per-token costs miss
            cost = k * costs.draft_ms_per_token + max(0.0, costs.verify_ms(k) - step)
        return max(self.every, math.ceil(cost / (self.budget * step)))

    def cheap_interval(self, extra_verify: float) -> int:
        """Steps between probes of a cheap drafter, whose verify (and its draft's cost per step) is
        what costs: ``extra_verify`` plain steps more than a plain step. At least ``every``, and at
        most ``budget`` of the plain steps between two probes (at batch 8 on a 2-core CPU that
        verify costs ~0.5 plain steps: a probe every 16 steps was 3 % of serving, the whole
        never-slower margin)."""
        return max(self.every, math.ceil(extra_verify / self.budget))

    def observe_cost(self, draft_ms: float, verify_ms: float, plain_ms: float) -> None:
        """A verified step: if it was a costly drafter's probe, what it cost over ``plain_ms``."""
        if not self.costly_now:
            return
        self.costly_now = False
        cost = draft_ms + max(0.0, verify_ms - plain_ms)
        self.cost_ms = cost if self.cost_ms is None else 0.7 * self.cost_ms + 0.3 * cost

    def restart(self) -> None:
        """A new drafter: probe it at the next step that would not draft."""
        self.off_streak = 0
        self.for_new_drafter = True
