"""KafkaTraceSource: the trainer's side of the trace topic.

At-least-once with manual commits: ``poll()`` returns decoded records, and ``commit()`` commits the
offsets of *everything returned by polls so far* (plus dead-lettered messages). Call it only once
those records were used (e.g. after the training step that consumed them): a crash before the
commit replays exactly the uncommitted batches, never earlier ones.

Messages that do not decode or validate go to the dead-letter topic with the original key and
bytes, and the error in headers (``specloop-error``, ``specloop-error-type``, ``specloop-source``
= ``topic/partition/offset``); consumption goes on. A dead letter the producer cannot take now
(broker away) is retried by ``commit``, which commits nothing until it is written; one too large
for the dead-letter producer (a message fetched past ``max_partition_fetch_bytes``) goes without
its bytes, with ``specloop-value-omitted`` = their size (the original stays at ``specloop-source``).
"""

from __future__ import annotations

import logging
from typing import Literal, Self

from prometheus_client import Counter
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from feedback.bus.codec import TraceDecodeError, decode
from feedback.bus.kafka_sink import REQUEST_OVERHEAD_BYTES
from feedback.bus.trace import TraceRecord

log = logging.getLogger(__name__)

TRACES_CONSUMED = Counter("specloop_traces_consumed_total", "Traces decoded by the trainer.")
TRACES_DEAD_LETTERED = Counter("specloop_traces_dead_lettered_total",
                               "Trace messages sent to the dead-letter topic.", ["error_type"])


def merge_windows(*windows: dict[int, tuple[int, int]]) -> dict[int, tuple[int, int]]:
    """Union of partition -> (first, last) offset ranges (each partition's min first, max last)."""
    out: dict[int, tuple[int, int]] = {}
    for w in windows:
        for part, (first, last) in (w or {}).items():
            part = int(part)
            if part in out:
                first, last = min(first, out[part][0]), max(last, out[part][1])
            out[part] = (int(first), int(last))
    return dict(sorted(out.items()))


def format_window(topic: str, window: dict[int, tuple[int, int]]) -> str:
    """``topic/0:12-57,topic/1:3-9`` (inclusive offsets; empty when nothing was consumed)."""
    return ",".join(f"{topic}/{p}:{a}-{b}" for p, (a, b) in sorted(window.items()))


class KafkaSourceSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECLOOP_KAFKA_")

    bootstrap_servers: str = Field("127.0.0.1:9092", description="Comma-separated host:port list.")
    topic: str = Field("specloop.traces", description="Trace topic to consume.")
    dlq_topic: str = Field("specloop.traces.dlq", description="Dead-letter topic.")
    dead_letter: bool = Field(True, description="Write undecodable messages to dlq_topic. False: "
                              "skip and count them only (readers besides the trainer, e.g. each "
                              "replica's trace follower, so that a bad message is dead-lettered "
                              "once, not once per reader).")
    group_id: str = Field("specloop-trainer", description="Consumer group (offsets live here).")
    auto_offset_reset: Literal["earliest", "latest"] = Field(
        "earliest", description="Where a group without committed offsets starts.")
    session_timeout_ms: int = Field(6_000, description="Group session timeout. kafka-python on "
                                    "tansu takes ~session_timeout/2 to get first records: keep "
                                    "it short in tests.")
    heartbeat_interval_ms: int = Field(1_000, description="Below session_timeout_ms / 3.")
    request_timeout_ms: int = Field(10_000, description="Must exceed session_timeout_ms.")
    max_partition_fetch_bytes: int = Field(8 << 20, description="Above the largest trace.")
    client_id: str = Field("specloop-trainer", description="Kafka client id.")
    metadata_max_age_ms: int = Field(
        5_000, description="Metadata refresh period. A consumer that subscribed before the topic "
        "existed (the first trace creates it) only sees it at the next refresh; kafka-python's "
        "default of 5 minutes would leave a fresh trainer idle that long.")


class KafkaTraceSource:
    """Consume TraceRecords from a consumer group; ``poll`` then ``commit`` once used.

    Unlike the sink this is not shielded from the broker: the constructor raises
    ``kafka.errors.NoBrokersAvailable`` when no broker answers (the trainer can wait and retry).
    """

    def __init__(self, settings: KafkaSourceSettings | None = None, **overrides):
        from kafka import KafkaConsumer, KafkaProducer
        from kafka.consumer.subscription_state import ConsumerRebalanceListener

        self.settings = s = (settings or KafkaSourceSettings()).model_copy(update=overrides)
        self.consumed = 0
        self.dead_lettered = 0
        self.last_window: dict[int, tuple[int, int]] = {}
        """Partition -> (first, last) offset of the records returned by the last poll."""
        self.lineage_window: dict[int, tuple[int, int]] = {}
        """Partition -> (first, last) offset of everything polled since ``mark_lineage()``: the
        exact trace range a drafter registered now was trained on (dead letters included)."""
        self._pending: dict = {}  # TopicPartition -> next offset to commit
        servers = s.bootstrap_servers.split(",")
        self._consumer = KafkaConsumer(
            bootstrap_servers=servers,
            client_id=s.client_id,
            group_id=s.group_id,
            enable_auto_commit=False,
            auto_offset_reset=s.auto_offset_reset,
            session_timeout_ms=s.session_timeout_ms,
            heartbeat_interval_ms=s.heartbeat_interval_ms,
            request_timeout_ms=max(s.request_timeout_ms, s.session_timeout_ms + 1_000),
            max_partition_fetch_bytes=s.max_partition_fetch_bytes,
            metadata_max_age_ms=s.metadata_max_age_ms,
        )
        # Not idempotent: a restarted tansu forgets producer ids, which is fatal to kafka-python.
        self._dlq = KafkaProducer(bootstrap_servers=servers, client_id=f"{s.client_id}-dlq",
                                  acks="all", enable_idempotence=False,
                                  max_request_size=s.max_partition_fetch_bytes + REQUEST_OVERHEAD_BYTES,
                                  ) if s.dead_letter else None
        self.skipped_undecodable = 0
        """Undecodable messages skipped without a dead letter (``dead_letter`` False)."""
        self._dlq_unconfirmed: list[tuple] = []  # (future or None, send kwargs) until the commit checks
        source = self

        class _DropRevoked(ConsumerRebalanceListener):
            """Uncommitted records of a revoked partition are redelivered to its new owner."""

            def on_partitions_revoked(self, revoked):
                for tp in revoked:
                    source._pending.pop(tp, None)

            def on_partitions_assigned(self, assigned):
                pass

        self._consumer.subscribe([s.topic], listener=_DropRevoked())

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def poll(self, max_records: int = 256, timeout: float = 1.0) -> list[TraceRecord]:
        """Up to ``max_records`` valid records, waiting up to ``timeout`` s for the first ones."""
        batches = self._consumer.poll(timeout_ms=int(timeout * 1000), max_records=max_records)
        records: list[TraceRecord] = []
        window: dict[int, tuple[int, int]] = {}
        for tp, messages in batches.items():
            for msg in messages:
                record = self._decode_or_dead_letter(msg)
                if record is not None:
                    records.append(record)
                self._pending[tp] = msg.offset + 1
            if messages:
                window[tp.partition] = (messages[0].offset, messages[-1].offset)
        self.last_window = window
        self.lineage_window = merge_windows(self.lineage_window, window)
        self.consumed += len(records)
        TRACES_CONSUMED.inc(len(records))
        return records

    def mark_lineage(self) -> None:
        """A version was registered: the next one's lineage starts after what was polled so far."""
        self.lineage_window = {}

    def commit(self) -> bool:
        """Commit everything returned by polls so far (and every dead letter).

        False when nothing was committed (a dead letter could not be written, the broker is away,
        the group rebalanced): try again later; a restart resumes from the last successful commit.
        """
        from kafka.errors import KafkaError
        from kafka.structs import OffsetAndMetadata

        if not self._pending:
            return True
        try:
            if not self._confirm_dead_letters():
                return False
            offsets = {tp: OffsetAndMetadata(off, "", -1) for tp, off in self._pending.items()}
            self._consumer.commit(offsets)
        except KafkaError as e:
            log.warning("offset commit failed: %s", e)
            return False
        self._pending.clear()
        return True

    def _confirm_dead_letters(self) -> bool:
        """Every dead letter is on the DLQ topic (resent once if needed) before offsets move on."""
        if self._dlq is None:
            return True
        self._dlq.flush(timeout=10)
        remaining = []
        for future, send in self._dlq_unconfirmed:
            if future is None or future.failed():
                try:
                    self._send_dead_letter(send).get(timeout=10)
                except Exception as e:  # noqa: BLE001
                    log.warning("dead letter not written (%s)", e)
                    remaining.append((future, send))
        self._dlq_unconfirmed = remaining
        if remaining:
            log.warning("%d dead letters not written: offsets not committed", len(remaining))
        return not remaining

    def committed(self) -> dict[int, int | None]:
        """Partition -> committed offset of the group (for tests and lag reports)."""
        return {tp.partition: self._consumer.committed(tp) for tp in self._consumer.assignment()}

    def close(self) -> None:
        """Leave the group without committing (uncommitted records will be delivered again)."""
        try:
            if self._dlq is not None:
                self._dlq.close(timeout=5)
        finally:
            self._consumer.close(autocommit=False)

    def _decode_or_dead_letter(self, msg) -> TraceRecord | None:
        try:
            if msg.value is None:
                raise TraceDecodeError("empty message")
            return decode(msg.value)
        except TraceDecodeError as e:
            error = e
        except Exception as e:  # noqa: BLE001 - a bug in decode must not stop consumption either
            error = e
        error_type = type(error).__name__
        if self._dlq is None:  # another reader (the trainer) dead-letters it
            self.skipped_undecodable += 1
            log.warning("skipping undecodable %s/%d/%d: %s", msg.topic, msg.partition, msg.offset, error)
            return None
        log.warning("dead-lettering %s/%d/%d: %s", msg.topic, msg.partition, msg.offset, error)
        headers = [
            ("specloop-error", str(error)[:1000].encode()),
            ("specloop-error-type", error_type.encode()),
            ("specloop-source", f"{msg.topic}/{msg.partition}/{msg.offset}".encode()),
            *(msg.headers or []),
        ]
        send = {"topic": self.settings.dlq_topic, "key": msg.key, "value": msg.value or b"",
                "headers": headers}
        try:
            future = self._send_dead_letter(send)
        except Exception as e:  # noqa: BLE001 - raising here would lose the rest of this poll's batch
            log.warning("dead letter not handed to the producer (%s): the commit retries it", e)
            future = None
        self._dlq_unconfirmed.append((future, send))
        self.dead_lettered += 1
        TRACES_DEAD_LETTERED.labels(error_type=error_type).inc()
        return None

    def _send_dead_letter(self, send: dict):
        """Hand a dead letter to the producer (its future); raises when the producer cannot take it."""
        from kafka.errors import MessageSizeTooLargeError

        try:
            return self._dlq.send(**send)
        except MessageSizeTooLargeError:
            send["headers"] = [*send["headers"], ("specloop-value-omitted", str(len(send["value"])).encode())]
            send["value"] = b""
            return self._dlq.send(**send)
