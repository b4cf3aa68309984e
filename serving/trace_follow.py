"""TraceFollower: each serving replica reads the trace topic into its suffix index, so what any
replica served (a prompt family seen only on replica A) becomes draftable on every replica.

A supervised thread polls the topic with a consumer group of this replica's own (every replica sees
every trace) and hands each record to the engine's current suffix drafter (the drafter itself, or
the suffix half of a hybrid; looked up per batch, so swaps are followed). The drafter skips the
requests it served itself (SuffixDrafter.observe_trace), and records of other tenants go to those
tenants' indexes. Records of another target (a topic shared by deployments of different models)
are skipped: their token ids mean other text here. Opted-out requests never reach the topic.
Offsets are committed after indexing.
"""

from __future__ import annotations

import logging
import threading

from prometheus_client import Counter

from feedback.background.supervise import SupervisedThread
from serving.drafters.suffix import suffix_part

log = logging.getLogger(__name__)

FOLLOWED = Counter("specloop_traces_followed", "Trace records read from the topic by this replica: "
                   "indexed into its suffix index, skipped (no suffix drafter live), or foreign "
                   "(traced for another target).", ["result"])


class TraceFollower:
    def __init__(self, engine, source_factory, replica_id: str, poll_records: int = 64,
                 poll_timeout_s: float = 0.5):
        """``source_factory()``: a KafkaTraceSource (poll/commit/close) in this replica's own group;
        called in the thread (and again after a failure), so a broker that is down at start only
        delays following."""
        self.engine, self.source_factory, self.replica_id = engine, source_factory, replica_id
        self.poll_records, self.poll_timeout_s = poll_records, poll_timeout_s
        self.indexed = 0
        self.skipped = 0
        self.foreign = 0
        self._stop = threading.Event()
        self._thread: SupervisedThread | None = None

    def _run(self) -> None:
        source = self.source_factory()
        try:
            while not self._stop.is_set():
                records = source.poll(self.poll_records, self.poll_timeout_s)
                if not records:
                    continue
                holder = suffix_part(getattr(self.engine, "drafter", None))
                ours = getattr(self.engine, "fingerprint", None)  # None: not known (yet)
                for rec in records:
                    if ours is not None and not ours.matches(rec.target):
                        if not self.foreign:
                            log.warning("trace topic holds traces of target %s; this replica serves "
                                        "%s: not indexed", rec.target, ours)
                        self.foreign += 1
                        FOLLOWED.labels(result="foreign").inc()
                        continue
                    if holder is None:
                        self.skipped += 1
                        FOLLOWED.labels(result="skipped").inc()
                        continue
                    holder.observe_trace(rec)
                    self.indexed += 1
                    FOLLOWED.labels(result="indexed").inc()
                source.commit()
        finally:
            source.close()

    def start(self) -> TraceFollower:
        self._thread = SupervisedThread(f"trace-follow-{self.replica_id}", self._run, self._stop).start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.poll_timeout_s + 5)
