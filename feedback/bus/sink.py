"""Where finished-request traces go. Serving hands records to a TraceSink and never waits on it."""

from __future__ import annotations

import collections
import threading
from typing import Protocol, runtime_checkable

from feedback.bus.trace import TraceRecord


@runtime_checkable
class TraceSink(Protocol):
    def emit(self, record: TraceRecord) -> None:
        """Hand over a record. Must not block or raise on the serving path."""

    def close(self) -> None: ...


class InProcessTraceSink:
    """Bounded in-memory queue: the embedded demo's and unit tests' transport.

    When full, the oldest records are dropped and counted in ``shed``, like the Kafka sink.
    """

    def __init__(self, maxlen: int = 10_000):
        self._records: collections.deque[TraceRecord] = collections.deque()
        self._maxlen = maxlen
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self.shed = 0
        self.emitted = 0

    def emit(self, record: TraceRecord) -> None:
        with self._cond:
            if len(self._records) >= self._maxlen:
                self._records.popleft()
                self.shed += 1
            self._records.append(record)
            self.emitted += 1
            self._cond.notify_all()

    def drain(self, max_records: int | None = None, timeout: float = 0.0) -> list[TraceRecord]:
        """Take up to ``max_records`` records, waiting up to ``timeout`` s for the first one."""
        with self._cond:
            if not self._records and timeout > 0:
                self._cond.wait(timeout)
            n = len(self._records) if max_records is None else min(max_records, len(self._records))
            return [self._records.popleft() for _ in range(n)]

    def __len__(self) -> int:
        return len(self._records)

    def close(self) -> None:
        pass


class NullTraceSink:
    def emit(self, record: TraceRecord) -> None:
        pass

    def close(self) -> None:
        pass
