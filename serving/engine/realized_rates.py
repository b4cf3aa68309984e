"""RealizedRates: what the steps that verified drafts delivered, per batch size.

The width step chooses from calibrated confidences over measured verify costs; at batch 8 with
cheap verifies (AMX) it kept predicting gains that ran at 0.93-0.95 of plain decoding. This keeps
the outcome: an EMA of tokens per millisecond (the draft included) over the steps that verified a
width the policy chose, so that ``GoodputPolicy.drafting_loses`` can compare it with a plain
step's rate, whatever the model missed.
"""

from __future__ import annotations

ALPHA = 0.05
"""EMA weight of one step; a probe, the only drafting step while drafting is off, weighs
``PROBE_ALPHA`` (a drafter that got better comes back within a few probes)."""
PROBE_ALPHA = 0.25
MIN_STEPS = 8
"""Drafting steps at a batch size before their rate is trusted."""


class RealizedRates:
    def __init__(self) -> None:
        self._rates: dict[int, tuple[float, int]] = {}
        """batch size -> (EMA of tokens per millisecond, steps seen)"""

    def observe(self, batch: int, tokens: float, ms: float, *, probe: bool = False) -> None:
        if ms <= 0:
            return
        alpha = PROBE_ALPHA if probe else ALPHA
        rate, n = self._rates.get(batch, (tokens / ms, 0))
        self._rates[batch] = ((1 - alpha) * rate + alpha * tokens / ms, n + 1)

    def below(self, batch: int, plain_ms: float | None) -> bool:
        """Whether drafting steps at ``batch`` rows delivered fewer tokens per millisecond than a
        plain step of ``plain_ms`` does (``batch`` tokens), over at least ``MIN_STEPS`` of them."""
        seen = self._rates.get(batch)
        if seen is None or plain_ms is None or seen[1] < MIN_STEPS:
            return False
        return seen[0] < batch / plain_ms
