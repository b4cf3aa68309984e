"""The trainer's side of the Redis control plane (feedback/control/plane.py): it trains only on spare
serving capacity, and announces promotions.

``ServingLoad`` is the loop's ``saturated()``: true while any live replica's heartbeat reports more
waiting requests than ``max_queue_depth``, or a busy fraction above ``max_utilisation`` (read from a
``utilisation`` field when heartbeats carry one; LoadHeartbeat has none yet). No live heartbeat, or
Redis down (the control plane then returns no loads), means serving is idle: train.
"""

from __future__ import annotations

import time

from feedback.control.plane import ControlPlane, SwapAnnouncement


class ServingLoad:
    def __init__(self, control: ControlPlane, max_queue_depth: int = 8, max_utilisation: float = 0.85,
                 cache_s: float = 0.5):
        self.control = control
        self.max_queue_depth = max_queue_depth
        self.max_utilisation = max_utilisation
        self.cache_s = cache_s
        """``saturated()`` is polled between training steps: re-read Redis at most this often."""
        self._checked_at = -float("inf")
        self._last = False

    def __call__(self) -> bool:
        now = time.monotonic()
        if now - self._checked_at >= self.cache_s:
            self._checked_at, self._last = now, self._busy()
        return self._last

    def _busy(self) -> bool:
        for beat in self.control.loads():
            if beat.queue_depth > self.max_queue_depth:
                return True
            util = getattr(beat, "utilisation", None)
            if util is not None and util > self.max_utilisation:
                return True
        return False


class RedisAnnouncer:
    """``announce(tenant, version)``: make the version current and publish a SwapAnnouncement."""

    def __init__(self, control: ControlPlane, drafter_kind: str | None = None, target_key: str | None = None):
        self.control = control
        self.drafter_kind = drafter_kind
        self.target_key = target_key

    def announce(self, tenant: str, version: str) -> None:
        previous = self.control.get_drafter_version(tenant)
        self.control.announce_swap(SwapAnnouncement(tenant=tenant, version=version, previous_version=previous,
                                                    drafter_kind=self.drafter_kind, target_key=self.target_key))
