"""GoodputPolicy: per step, the k in 0..k_max with the highest expected tokens per second.

The goodput model is serving/adaptive_k.py (``best_k`` over an ``AcceptanceEstimate`` and a
``CostModel``); this class only feeds it from the engine's ``observe`` calls:

- acceptance: every step's drafted/accepted counts (rows that drafted nothing carry no signal);
- draft cost: the batch's draft milliseconds per drafted position (k, not k x rows: the whole batch
  waits for the draft, so the cost per position is what trades against tokens per row);
- verify cost: per verified width (the widest row's drafts, not the k asked for: a drafter that
  found nothing to propose leaves a plain decoding step). Until k = 0 has been measured, the k = 0
  cost is inferred from the measured widths with the CostModel's slope, so the prior of another
  machine cannot make speculation look better or worse than it is here.

k = 0 is sticky (no drafts, so no acceptance evidence), so every ``probe_every`` consecutive k = 0
steps one step drafts ``probe_k`` tokens to refresh the estimate: a drafter that got better (a swap,
a suffix index that learned the new domain) is noticed within a few probes.
"""

from __future__ import annotations

import numpy as np

from serving.adaptive_k import AcceptanceEstimate, CostModel, best_k
from serving.engine.policy import BatchState


class GoodputPolicy:
    def __init__(
        self,
        k_max: int,
        *,
        probe_every: int = 16,
        probe_k: int | None = None,
        acceptance: AcceptanceEstimate | None = None,
        costs: CostModel | None = None,
    ):
        if k_max < 0:
            raise ValueError(f"k_max must be >= 0, got {k_max}")
        if probe_every < 1:
            raise ValueError(f"probe_every must be >= 1, got {probe_every}")
        self.k_max = k_max
        self.probe_every = probe_every
        self.probe_k = min(k_max, probe_k if probe_k is not None else 2)
        self.acceptance = acceptance or AcceptanceEstimate()
        self.costs = costs or CostModel()
        self.off_streak = 0
        """Consecutive steps decided as k = 0 (a probe resets it)."""
        self.probes = 0
        self.chosen: list[int] = []
        """Recent choices (bounded), for benchmarks and debugging."""
        self._k0_measured = False

    def choose_k(self, state: BatchState) -> int:
        k_max = min(self.k_max, state.k_max)
        k = best_k(self.acceptance.value, k_max, self.costs) if k_max > 0 else 0
        if k == 0 and k_max > 0:
            self.off_streak += 1
            if self.off_streak >= self.probe_every:
                self.off_streak = 0
                self.probes += 1
                k = max(1, self.probe_k)
        else:
            self.off_streak = 0
        self._remember(k)
        return k

    def observe(self, k, num_drafted, num_accepted, draft_ms, verify_ms) -> None:
        drafted = np.asarray(num_drafted)
        accepted = np.asarray(num_accepted)
        self.acceptance.observe(drafted, accepted)
        width = int(drafted.max()) if drafted.size else 0
        if width > 0:
            self.costs.observe_draft(width, draft_ms)
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
