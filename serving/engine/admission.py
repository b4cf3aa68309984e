"""Admission control, one rule for every engine: a bound on the requests in flight.

A request is in flight from ``admit`` (``generate`` accepted it) to ``release`` (it finished,
failed or was aborted): running in the batch or queued for a place in it. At most
``max_running + max_waiting`` are in flight; one more is refused at once with Overloaded (HTTP 429
with Retry-After) and nothing of it is kept. ``max_waiting`` or ``max_running`` None: no bound.
"""

from __future__ import annotations

import threading

from serving.engine.base import Overloaded, RequestError


class AdmissionGate:
    def __init__(self, max_running: int | None, max_waiting: int | None, retry_after_s: float = 1.0):
        self.max_running = max_running
        """The engine's running-batch size: requests beyond it wait for a place."""
        self.max_waiting = max_waiting
        self.retry_after_s = retry_after_s
        self.in_flight: set[str] = set()
        self.refused = 0
        """Requests refused for overload so far."""
        self._lock = threading.Lock()

    @property
    def limit(self) -> int | None:
        """Most requests in flight; None = unbounded."""
        if self.max_running is None or self.max_waiting is None:
            return None
        return self.max_running + self.max_waiting

    def admit(self, request_id: str) -> None:
        """Count ``request_id`` in flight, or raise: RequestError (invalid) for an id already in
        flight, Overloaded when the bound is reached."""
        with self._lock:
            if request_id in self.in_flight:
                raise RequestError(f"request id {request_id!r} is already running", invalid=True)
            limit = self.limit
            if limit is not None and len(self.in_flight) >= limit:
                self.refused += 1
                raise Overloaded(
                    f"the engine is at capacity ({len(self.in_flight)} requests running or queued); "
                    f"retry after {self.retry_after_s:g}s",
                    self.retry_after_s,
                )
            self.in_flight.add(request_id)

    def release(self, request_id: str) -> None:
        """``request_id`` is no longer in flight (a no-op when it was not)."""
        with self._lock:
            self.in_flight.discard(request_id)

    def load(self) -> tuple[int, int]:
        """(waiting, running) of the requests in flight where the engine does not say which is
        which (SGLang queues inside its scheduler): those beyond the running-batch size wait."""
        with self._lock:
            n = len(self.in_flight)
        running = n if self.max_running is None else min(n, self.max_running)
        return n - running, running

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.in_flight
