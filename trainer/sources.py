"""Trace sources for the trainer loop: ``poll(max_records, timeout) -> list[TraceRecord]`` and
``commit()`` (acknowledge everything polled so far). KafkaTraceSource (feedback/) has the same shape."""

from __future__ import annotations

import collections
import time

from feedback.bus.trace import TraceRecord


class ListTraceSource:
    """In-process source over a list, an iterable, or an InProcessTraceSink (``drain``).

    ``committed`` counts records acknowledged; records polled but not committed are handed out
    again by ``rewind()`` (what a consumer restart does with uncommitted Kafka offsets).
    """

    def __init__(self, records=None, sink=None):
        self._pending: collections.deque[TraceRecord] = collections.deque(records or [])
        self._sink = sink
        self._uncommitted: list[TraceRecord] = []
        self.committed = 0

    def push(self, records) -> None:
        self._pending.extend(records)

    def poll(self, max_records: int = 64, timeout: float = 0.0) -> list[TraceRecord]:
        if self._sink is not None:
            self._pending.extend(self._sink.drain(max_records, timeout))
        out = [self._pending.popleft() for _ in range(min(max_records, len(self._pending)))]
        self._uncommitted.extend(out)
        return out

    def commit(self) -> None:
        self.committed += len(self._uncommitted)
        self._uncommitted.clear()

    def rewind(self) -> None:
        self._pending.extendleft(reversed(self._uncommitted))
        self._uncommitted.clear()

    def close(self) -> None:
        pass


class TimedSource:
    """Wraps a source and remembers when each request's trace first reached the trainer (the start
    of its freshness: trace polled -> a drafter trained on it is live)."""

    def __init__(self, source):
        self.source = source
        self.polled_at: dict[str, float] = {}

    def poll(self, max_records: int = 64, timeout: float = 1.0) -> list[TraceRecord]:
        recs = self.source.poll(max_records, timeout)
        now = time.time()
        for r in recs:
            self.polled_at.setdefault(r.request_id, now)
        return recs

    def __getattr__(self, name):
        return getattr(self.source, name)
