"""ConfidenceCalibration: how far a drafter's confidences are to be believed.

The width step prices each drafted node at the product of the drafter's confidences along its
path times ``value``, the ratio of accepted to predicted tokens over recent steps. It is a ratio of
two EMAs, not an EMA of per-step ratios: a one-token draft's ratio is 0 or ~2.5 at every step, an
EMA of those read 0.26-0.87 within 16 HumanEval requests of a selfspec drafter, and paid drafts
were cut on its dips. Simulated for a drafter whose confidences are right (0.4, one token), the
5th-95th percentiles are 0.50-1.40 for the EMA of ratios and 0.68-1.40 for this: the low dips are
rarer, not gone (tests/serving/test_calibration.py); the width step's floor for a costly drafter's
paid draft does the rest.
"""

from __future__ import annotations

_EMA = 0.05
_PRIOR_TOKENS = 0.2
"""Both EMAs start here (~4 predicted tokens of evidence at ``_EMA``): a calibration of 1.0 until
steps say otherwise."""


class ConfidenceCalibration:
    def __init__(self) -> None:
        self.value = 1.0
        """Accepted / predicted tokens: what the drafter's confidences are multiplied by."""
        self._accepted = self._predicted = _PRIOR_TOKENS

    def observe(self, accepted: float, predicted: float) -> None:
        """One verify step: ``accepted`` tokens where the calibrated confidences of the verified
        nodes summed to ``predicted``."""
        if predicted <= 0:
            return
        self._accepted = (1 - _EMA) * self._accepted + _EMA * float(accepted)
        self._predicted = (1 - _EMA) * self._predicted + _EMA * float(predicted) / self.value
        self.value = min(max(self._accepted / self._predicted, 0.05), 2.0)
