"""The trainer's side of the control plane's announcements (feedback/control/plane.py).

Serving's drift reports and rollbacks for this trainer's tenant arrive on any thread and are queued;
the round thread applies them at the start of a round (trainer/loop.py). A drift focuses training
on its domain for a few trained rounds (``focus``: the replay's sampling boost); rollbacks are
handed to the loop, which reverts its champion.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Iterator

log = logging.getLogger(__name__)


class Announcements:
    def __init__(self, tenant: str, drift_boost: float, drift_rounds: int):
        """A drift's domain is sampled ``drift_boost`` times more for ``drift_rounds`` trained rounds."""
        self.tenant = tenant
        self.drift_boost = drift_boost
        self.drift_rounds = drift_rounds
        self.drifts: queue.Queue = queue.Queue()
        self.rollbacks: queue.SimpleQueue = queue.SimpleQueue()
        self.focus_until: dict[str, int] = {}
        """Drifted domain -> the round count its focus lasts until (exclusive)."""

    def on_announcement(self, msg) -> None:
        """Control-plane announcements (any thread): rollbacks and drifts of this tenant."""
        if getattr(msg, "tenant", self.tenant) != self.tenant:
            return
        if getattr(msg, "kind", None) == "drift":
            self.drifts.put(msg)
        else:
            self.on_rollback(msg)

    def on_rollback(self, msg) -> None:
        """A RollbackAnnouncement of this tenant (any thread): queued for ``take_rollbacks``."""
        if getattr(msg, "kind", None) == "rollback" and getattr(msg, "tenant", self.tenant) == self.tenant:
            self.rollbacks.put(msg)

    def apply_drifts(self, rounds: int, ops=None) -> int:
        """Focus on each queued drift's domain until ``drift_rounds`` after ``rounds`` (the trained
        rounds so far), and drop the focuses that ran out. Returns the drifts applied."""
        n = 0
        while True:
            try:
                msg = self.drifts.get_nowait()
            except queue.Empty:
                break
            n += 1
            self.focus_on(msg.domain, rounds)
            log.info("drift on %s (%.2f -> %.2f, %s): focusing training there", msg.domain,
                     msg.before, msg.now, msg.replica_id)
            if ops is not None:
                ops.event("drift", rounds, domain=msg.domain, before=msg.before, now=msg.now,
                          replica=msg.replica_id)
        self.focus_until = {d: r for d, r in self.focus_until.items() if r > rounds}
        return n

    def focus_on(self, domain: str, rounds: int) -> None:
        """Sample ``domain`` ``drift_boost`` times more for ``drift_rounds`` trained rounds from
        ``rounds`` (a drift serving reported, or a shift of the traffic the trainer saw)."""
        self.focus_until[domain] = rounds + self.drift_rounds

    def focus(self) -> dict[str, float]:
        """Domain -> sampling boost for the replay (ReplayBuffer.focus)."""
        return {d: self.drift_boost for d in self.focus_until}

    def take_rollbacks(self) -> Iterator:
        """The queued rollbacks, oldest first, each taken off the queue as it is reached."""
        while True:
            try:
                yield self.rollbacks.get_nowait()
            except queue.Empty:
                return
