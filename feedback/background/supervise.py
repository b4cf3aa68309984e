"""Supervision for background loops: catch, count, log, back off, go on; restart a loop that died.

Every long-running loop of the system (the Kafka sink's sender, the Swapper's watcher, the control
subscriber, trace consumers, the trainer's rounds) runs under this module, so a failure is never
silent: it is counted in Prometheus, logged with its traceback, and the loop is down (``/health``
answers 503 naming it) until it runs again after a capped exponential back-off.

Two tools:

- ``LoopStatus.guard()`` around one iteration of a loop that handles its own looping (the trainer's
  ``run``): an exception is counted and logged, the status turns down, the caller backs off.
- ``SupervisedThread``: runs a loop function in a daemon thread; if the function raises (or returns
  while not asked to stop) it is restarted after a back-off.

PromQL, loops currently down and their error rate::

    specloop_loop_up == 0
    sum by (loop) (rate(specloop_loop_errors_total[5m]))
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import Counter, Gauge

log = logging.getLogger(__name__)

LOOP_ERRORS = Counter("specloop_loop_errors_total", "Exceptions caught in a background loop.", ["loop"])
LOOP_RESTARTS = Counter("specloop_loop_restarts_total", "Background loops restarted after dying.", ["loop"])
LOOP_UP = Gauge("specloop_loop_up", "1 while a background loop runs, 0 while it is down.", ["loop"])


@dataclass
class Backoff:
    """Capped exponential back-off: ``initial_s``, doubled per consecutive failure, at most ``max_s``."""

    initial_s: float = 0.5
    max_s: float = 30.0
    factor: float = 2.0
    _failures: int = 0

    def next(self) -> float:
        delay = min(self.max_s, self.initial_s * self.factor ** self._failures)
        self._failures += 1
        return delay

    def reset(self) -> None:
        self._failures = 0


@dataclass
class LoopStatus:
    """The health of one loop; lives in a ``LoopRegistry`` while the loop is registered."""

    name: str
    up: bool = True
    errors: int = 0
    restarts: int = 0
    last_error: str = ""
    down_since: float | None = None
    backoff: Backoff = field(default_factory=Backoff)

    def failed(self, error: BaseException) -> float:
        """Count and log ``error``, mark the loop down; returns how long to back off."""
        self.errors += 1
        self.up = False
        self.last_error = f"{type(error).__name__}: {error}"
        if self.down_since is None:
            self.down_since = time.time()
        LOOP_ERRORS.labels(loop=self.name).inc()
        LOOP_UP.labels(loop=self.name).set(0)
        delay = self.backoff.next()
        log.error("loop %s failed (%d so far), retrying in %.1fs", self.name, self.errors, delay,
                  exc_info=error)
        return delay

    def ok(self, reset: bool = True) -> None:
        """The loop is up again; ``reset``: it made progress, so the back-off starts over."""
        if not self.up:
            log.warning("loop %s is running again", self.name)
        self.up, self.down_since = True, None
        if reset:
            self.backoff.reset()
        LOOP_UP.labels(loop=self.name).set(1)

    @contextlib.contextmanager
    def guard(self, wait: Callable[[float], object] = time.sleep) -> Iterator[None]:
        """Run one iteration: on an exception count it, log it and ``wait`` the back-off; on
        success mark the loop up. ``wait`` may be a stop event's ``wait`` (interruptible)."""
        try:
            yield
        except Exception as e:  # noqa: BLE001 - the point: nothing ends the loop
            wait(self.failed(e))
        else:
            self.ok()

    def as_dict(self) -> dict:
        return {"up": self.up, "errors": self.errors, "restarts": self.restarts,
                "last_error": self.last_error, "down_since": self.down_since}


class LoopRegistry:
    """The loops of this process, by name (a second loop of the same name gets a ``#n`` suffix)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loops: dict[str, LoopStatus] = {}

    def register(self, name: str, backoff: Backoff | None = None) -> LoopStatus:
        with self._lock:
            key, n = name, 1
            while key in self._loops:
                n += 1
                key = f"{name}#{n}"
            status = LoopStatus(key, backoff=backoff or Backoff())
            self._loops[key] = status
        LOOP_UP.labels(loop=key).set(1)
        return status

    def unregister(self, status: LoopStatus) -> None:
        with self._lock:
            if self._loops.get(status.name) is status:
                del self._loops[status.name]

    def down(self) -> dict[str, dict]:
        """The loops that are down now, with their last error."""
        with self._lock:
            return {k: s.as_dict() for k, s in self._loops.items() if not s.up}

    def snapshot(self) -> dict[str, dict]:
        with self._lock:
            return {k: s.as_dict() for k, s in self._loops.items()}


LOOPS = LoopRegistry()
"""The process-wide registry ``/health`` reads."""


class SupervisedThread:
    """``target()`` in a daemon thread, restarted after a back-off whenever it raises or returns
    while ``stop`` is not set. ``stop`` is the loop's own stop event (the target should return
    promptly once it is set)."""

    def __init__(self, name: str, target: Callable[[], None], stop: threading.Event,
                 backoff: Backoff | None = None, registry: LoopRegistry = LOOPS):
        self.target, self.stop_event, self.registry = target, stop, registry
        self.status = registry.register(name, backoff)
        self._thread = threading.Thread(target=self._supervise, name=name, daemon=True)

    @property
    def name(self) -> str:
        return self.status.name

    def start(self) -> SupervisedThread:
        self._thread.start()
        return self

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.registry.unregister(self.status)

    def _supervise(self) -> None:
        while not self.stop_event.is_set():
            started = time.monotonic()
            try:
                self.target()
                if self.stop_event.is_set():
                    break
                raise RuntimeError("loop returned without being stopped")
            except Exception as e:  # noqa: BLE001
                if time.monotonic() - started > self.status.backoff.max_s:
                    self.status.backoff.reset()  # it ran a good while: not a crash loop
                delay = self.status.failed(e)
            if self.stop_event.wait(delay):
                break
            self.status.restarts += 1
            LOOP_RESTARTS.labels(loop=self.name).inc()
            log.warning("restarting loop %s (restart %d)", self.name, self.status.restarts)
            self.status.ok(reset=False)  # running again; a crash loop keeps backing off longer
