"""The cap on client-chosen domains tracked one by one (feedback/ops/domains.py)."""

from __future__ import annotations

import pytest

from feedback.ops.domains import DEFAULT, OTHER, DomainCap
from feedback.ops.drift import DriftDetector


def test_the_first_domains_are_tracked_and_the_rest_are_other_for_good():
    cap = DomainCap(3)
    assert [cap(d) for d in ("code", "chat", "code", "math")] == ["code", "chat", "code", "math"]
    assert cap("legal") == OTHER and cap("x" * 128) == OTHER
    assert [cap(d) for d in ("math", "code")] == ["math", "code"]  # a tracked name stays tracked
    assert cap.tracked == {"code", "chat", "math"} and cap.overflowed == 2


def test_no_domain_and_other_take_no_place():
    cap = DomainCap(1)
    assert cap(None) == cap("") == DEFAULT and cap(OTHER) == OTHER
    assert cap("code") == "code" and cap("chat") == OTHER
    with pytest.raises(ValueError):
        DomainCap(-1)
    assert DomainCap(0)("code") == OTHER


def test_a_thousand_client_domains_make_a_bounded_detector():
    """The audit's case: 1,000 one-request domains left 1,000 detector states; through the cap, 33."""
    cap, detector = DomainCap(32), DriftDetector()
    for i in range(1000):
        detector.observe(cap(f"user-text-{i}"), 2, 1)
    assert len(detector.domains) == 33 and OTHER in detector.domains
