"""What a Swapper writes to the drafter registry (MLflow), off the swapping thread.

Event tags (swapped in, rolled back, refused), the champion alias after a rollback and live
acceptance are written on one background thread, in order, so that the thread handing drafters
to the engine never waits on MLflow (slow, or down). Events are not written at the swap at all:
they wait for the Swapper's periodic flush. One write to a sqlite-backed MLflow costs 6-8 ms of
CPU; made at the handover, on two cores that both decode, it was most of the decoding a swap cost
(`bench swap`: median stall 18-21 ms with it, 1-4 ms without; ARCHITECTURE.md).

The alias move of a rollback is the one write that is tried again: a replica started later reads
the alias, and one left on a rolled-back version would swap that version back in. A failed move
is retried at every flush until it is done or a newer move replaces it, and a move does nothing
where the alias is no longer on the version rolled back (a promotion moved it since).
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
        self._alias: tuple[int, str, str | None] | None = None
        """The alias move not done yet: (its number, off this version, to this one or None)."""
        self._alias_moves = 0
        self._alias_in_flight = 0

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

    def move_champion(self, off: str, to: str | None) -> None:
        """Move the champion alias off ``off`` (a version rolled back) to ``to``, or clear it when
        ``to`` is None (the tenant is back on a drafter the registry does not hold, e.g. day 0)."""
        with self._lock:
            self._alias_moves += 1
            self._alias = (self._alias_moves, off, to)
        self._submit_alias(retry=False)

    def write_events(self) -> None:
        """Queue the noted events and metrics for writing, and an alias move still to be done."""
        self._submit_alias(retry=True)
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

    def _submit_alias(self, retry: bool) -> None:
        with self._lock:
            move = self._alias
            if self.registry is None or move is None or (retry and self._alias_in_flight):
                return
            self._alias_in_flight += 1
        self._last = self._writer.submit(self._move_now, *move)

    def _move_now(self, number: int, off: str, to: str | None) -> None:
        error = None
        try:
            champion = self.registry.champion(self.tenant)
            if champion is not None and champion.version == off:  # else: moved since, or done
                if to is None:
                    self.registry.clear_champion(self.tenant)
                else:
                    self.registry.set_champion(self.tenant, to)
        except Exception as e:  # noqa: BLE001 - reported; tried again at the next flush
            error = e
        with self._lock:
            self._alias_in_flight -= 1
            if error is None and self._alias is not None and self._alias[0] == number:
                self._alias = None
        self._on_result("set_champion" if to is not None else "clear_champion", error)

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


class SwapFreshness:
    """Which swaps a version's freshness is logged at: the first of the version in this process,
    where it follows a promotion (``PROMOTED``: an announcement, or the alias moving while this
    process watched it). A later swap of the same version (an operator's, a rollback's), or the
    swap of a replica started after the promotion (the alias's version at its first look), would
    measure how long the version had been live, not how fresh it was when it went live."""

    PROMOTED = ("announcement", "champion alias")

    def __init__(self):
        self._swapped_in: set[str] = set()
        self._alias_seen = False
        self._before_start: str | None = None

    def alias_read(self, version: str | None) -> None:
        """The champion alias read ``version`` (None: no champion) at a poll."""
        if not self._alias_seen:
            self._alias_seen, self._before_start = True, version

    def swapped_in(self, version: str, reason: str, drafter, now: float | None = None) -> dict[str, float]:
        """``trace_freshness(drafter)`` where this swap of ``version`` is the one to log it at, else {}."""
        first = version not in self._swapped_in
        self._swapped_in.add(version)
        if first and reason in self.PROMOTED and version != self._before_start:
            return trace_freshness(drafter, now)
        return {}
