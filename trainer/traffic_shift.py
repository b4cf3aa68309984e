"""A domain that serving's traffic moved to, seen from the traces that arrive.

Serving reports a drift when a domain's live acceptance falls (feedback/ops/drift.py), and the trainer
then focuses its training there for a few rounds. A shift to a domain the learned drafter has not
learned need not lower live acceptance: after MT-Bench chat, HumanEval code raises it, because the
suffix index repeats code well, and the learned drafter is left training on the old mix (its replay
samples by recency with a half-life of hundreds of traces, so 40 chat traces outweigh the first 10
code ones for a long time). The trainer sees the shift itself, in the arrivals' domains: a domain
that makes up a good part of the latest arrivals but a small part of what training samples is
where the traffic went. It is focused on like a drift (trainer/announcements.py).
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass
class TrafficShift:
    window: int = 16
    """Latest arrivals (training and held-out traces) whose domains are the traffic now."""
    min_share: float = 0.25
    """A domain this much of the window or more..."""
    ratio: float = 2.0
    """...and at least this many times its share of what training samples (the replay's recency
    weights, before any focus) is a shift to it."""
    _recent: collections.deque = field(init=False)

    def __post_init__(self) -> None:
        self._recent = collections.deque(maxlen=self.window)

    def observe(self, domains) -> None:
        """The domains of traces that arrived, in order (``TraceRecord.domain``; None = "default")."""
        self._recent.extend(d or "default" for d in domains)

    def shares(self) -> dict[str, float]:
        """Each domain's share of the latest ``window`` arrivals."""
        n = len(self._recent)
        return {d: c / n for d, c in collections.Counter(self._recent).items()} if n else {}

    def shifted(self, trained: dict[str, float]) -> dict[str, tuple[float, float]]:
        """Domains the traffic shifted to: {domain: (share of the window, share of training)}.
        ``trained``: each domain's share of what training samples (``ReplayBuffer.domain_shares``).
        Nothing before the window is full: at the start every domain is as new in the window as
        in the replay."""
        if len(self._recent) < self.window or not trained:
            return {}
        return {d: (s, trained.get(d, 0.0)) for d, s in self.shares().items()
                if s >= self.min_share and s >= self.ratio * trained.get(d, 0.0)}


def focus_shifts(traffic: TrafficShift, replay, announcements, rounds: int, ops=None) -> int:
    """Focus ``announcements`` (trainer/announcements.py) on each domain ``traffic`` shifted to,
    for as long as it stays shifted and ``drift_rounds`` trained rounds more, and set the
    ``replay``'s focus. A domain not focused already is logged as a new shift. Returns how many."""
    n = 0
    for domain, (now, trained) in traffic.shifted(replay.domain_shares()).items():
        new = domain not in announcements.focus_until
        announcements.focus_on(domain, rounds)
        if not new:
            continue
        n += 1
        log.info("traffic shifted to %s (%.0f%% of the latest arrivals, %.0f%% of what training "
                 "samples): focusing training there", domain, 100 * now, 100 * trained)
        if ops is not None:
            ops.event("traffic_shift", rounds, domain=domain, share_of_arrivals=round(now, 4),
                      share_of_training=round(trained, 4))
    if n:  # a lasting shift's refresh keeps the focus the replay has
        replay.focus = announcements.focus()
    return n
