"""What a Swapper writes to the drafter registry (MLflow), off the swapping thread.

Event tags (swapped in, rolled back, refused), the champion alias after a rollback and live
acceptance are written on one background thread, in order, so that the thread handing drafters
to the engine never waits on MLflow (slow, or down). Events are not written at the swap at all:
they wait for the Swapper's periodic flush. One write to a sqlite-backed MLflow costs 6-8 ms of
CPU; made at the handover, on two cores that both decode, it was most of the decoding a swap cost
(`bench swap`: median stall 18-21 ms with it, 1-4 ms without; ARCHITECTURE.md).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable

from feedback.background.priority import BackgroundWorker
from feedback.registry.artifact_keys import (
    EXTRA_TRACE_FINISHED_MEDIAN_AT,
    EXTRA_TRACE_FINISHED_NEWEST_AT,
)


class RegistryRecords:
    def __init__(self, registry, tenant: str, nice: int,
                 on_result: Callable[[str, Exception | None], None]):
        """``registry``: a DrafterRegistry, or None (nothing is written); ``on_result(method,
        error)`` is called on the writer thread after every write (error None when it worked)."""
        self.registry = registry
        self.tenant = tenant
        self._on_result = on_result
        self._writer = BackgroundWorker("drafter-records", nice, "registry records")
        self._last: concurrent.futures.Future | None = None
        self._events: list[tuple[str, str, tuple]] = []  # (method, version, args), not written yet
        self._last_at = 0.0
        self._lock = threading.Lock()

    def note_event(self, version: str, text: str) -> None:
        """An event tag for ``version``, stamped now, written at the next ``write_events``. Tags
        are keyed by their time to the millisecond: each event gets a millisecond of its own."""
        with self._lock:
            self._last_at = max(time.time(), self._last_at + 0.001)
            self._events.append(("log_event", version, (text, self._last_at)))

    def note_metrics(self, version: str, metrics: dict[str, float]) -> None:
        """Metrics of ``version`` (logged on the run that produced it), written with the events."""
        with self._lock:
            self._events.append(("log_version_metrics", version, (dict(metrics),)))

    def write_events(self) -> None:
        """Queue the noted events and metrics for writing."""
        with self._lock:
            events, self._events = self._events, []
        for method, version, args in events:
            self.write(method, version, *args)

    def write(self, method: str, version: str, *args) -> None:
        """``registry.method(tenant, version, *args)`` on the writer thread, after those before."""
        if self.registry is not None:
            self._last = self._writer.submit(self._write_now, method, version, *args)

    def flush(self, timeout: float = 10.0) -> bool:
        """Write the noted events and wait until every write queued so far is done (or failed);
        False on timeout."""
        self.write_events()
        last = self._last
        if last is None:
            return True
        try:
            last.result(timeout)
        except concurrent.futures.TimeoutError:
            return False
        return True

    def stop(self) -> None:
        self._writer.stop()

    def _write_now(self, method: str, version: str, *args) -> None:
        try:
            getattr(self.registry, method)(self.tenant, version, *args)
        except Exception as e:  # noqa: BLE001 - reported; serving goes on
            self._on_result(method, e)
        else:
            self._on_result(method, None)


def trace_freshness(drafter, now: float | None = None) -> dict[str, float]:
    """How fresh a drafter swapped in ``now`` is, from the trace times its artifact records
    (``trace_times``, trainer/lineage.py; a hybrid's are its learned half's): ``freshness_s``, from
    the median request finishing among the traces this version was the first trained on to now,
    and ``newest_trace_age_s``, from the newest. {} for a drafter without them (day 0, suffix)."""
    times = getattr(drafter, "trace_times", None) or getattr(getattr(drafter, "learned", None), "trace_times", None)
    if not times:
        return {}
    now = time.time() if now is None else now
    out = {}
    if EXTRA_TRACE_FINISHED_MEDIAN_AT in times:
        out["freshness_s"] = now - times[EXTRA_TRACE_FINISHED_MEDIAN_AT]
    if EXTRA_TRACE_FINISHED_NEWEST_AT in times:
        out["newest_trace_age_s"] = now - times[EXTRA_TRACE_FINISHED_NEWEST_AT]
    return out
