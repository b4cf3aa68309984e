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
The dead-letter producer blocks for at most ``dlq_max_block_ms`` and a commit waits for dead letters
at most ``dlq_timeout_ms``: a dead letter that cannot be written is counted and logged, never waited on.

A broker that is away when the source starts (the trainer's Ray actor builds it in its constructor,
which Ray does not retry) is waited for: ``poll`` returns nothing and retries the connection with a
capped exponential back-off until one answers.
"""

from __future__ import annotations

import logging
import time
from typing import Literal, Self

from prometheus_client import Counter
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from feedback.background.supervise import Backoff
from feedback.bus.codec import TraceDecodeError, decode
from feedback.bus.kafka_sink import REQUEST_OVERHEAD_BYTES
from feedback.bus.trace import TraceRecord

log = logging.getLogger(__name__)

TRACES_CONSUMED = Counter("specloop_traces_consumed_total", "Traces decoded by the trainer.")
TRACES_DEAD_LETTERED = Counter("specloop_traces_dead_lettered_total",
                               "Trace messages sent to the dead-letter topic.", ["error_type"])
DEAD_LETTER_SEND_FAILURES = Counter(
    "specloop_dead_letter_send_failures_total",
    "Dead letters the producer could not take or deliver in time (broker away); the next commit "
    "retries them and commits no offsets until they are written.")


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
    bootstrap_timeout_ms: int = Field(2_000, description="One connection attempt (the consumer's, then "
                                      "the dead-letter producer's); a poll waits this long at most for it.")
    reconnect_backoff_max_s: float = Field(30.0, description="Longest wait between connection attempts "
                                           "while no broker answers (doubled from 0.5 s per failure).")
    dlq_max_block_ms: int = Field(2_000, description="Longest the dead-letter producer blocks a poll or "
                                  "commit (metadata, buffer space) while the broker is away.")
    dlq_timeout_ms: int = Field(5_000, description="Longest a commit waits for dead letters to be written "
                            "(then it commits nothing and the next commit retries them).")


class KafkaTraceSource:
    """Consume TraceRecords from a consumer group; ``poll`` then ``commit`` once used.

    The constructor does not connect. ``poll`` connects (the consumer, then the dead-letter
    producer) and, while no broker answers, returns no records after its timeout, logs a warning
    and retries after a capped exponential back-off (``reconnect_backoff_max_s``); one attempt
    lasts ``bootstrap_timeout_ms`` at most. Once connected, kafka-python reconnects by itself.
    ``connected`` and ``connect_failures`` tell where it stands.
    """

    def __init__(self, settings: KafkaSourceSettings | None = None, **overrides):
        self.settings = s = (settings or KafkaSourceSettings()).model_copy(update=overrides)
        self.consumed = 0
        self.dead_lettered = 0
        self.dead_letter_send_failures = 0
        """Dead letters the producer could not take or deliver in time (each retried by a commit)."""
        self.last_window: dict[int, tuple[int, int]] = {}
        """Partition -> (first, last) offset of the records returned by the last poll."""
        self.lineage_window: dict[int, tuple[int, int]] = {}
        """Partition -> (first, last) offset of everything polled since ``mark_lineage()``: the
        exact trace range a drafter registered now was trained on (dead letters included)."""
        self._pending: dict = {}  # TopicPartition -> next offset to commit
        self.skipped_undecodable = 0
        """Undecodable messages skipped without a dead letter (``dead_letter`` False)."""
        self._dlq_unconfirmed: list[tuple] = []  # (future or None, send kwargs) until the commit checks
        self._consumer = None
        self._dlq = None
        self._closed = False
        self.connect_failures = 0
        """Failed connection attempts since the last success."""
        self._backoff = Backoff(initial_s=min(0.5, s.reconnect_backoff_max_s), max_s=s.reconnect_backoff_max_s)
        self._connect_at = 0.0  # time.monotonic() of the next connection attempt

    @property
    def connected(self) -> bool:
        return self._consumer is not None

    def _connect(self, timeout: float) -> bool:
        """Connected, or one attempt if one is due within ``timeout`` s (else wait that long)."""
        if self._consumer is not None:
            return True
        if self._closed:
            return False
        wait = self._connect_at - time.monotonic()
        if wait > 0:  # a caller polling in a loop must not spin while the broker is away
            time.sleep(max(0.0, min(wait, timeout)))
            if wait > timeout:
                return False
        from kafka.errors import KafkaError

        try:
            self._consumer, self._dlq = self._build()
        except (KafkaError, OSError) as e:
            self.connect_failures += 1
            delay = self._backoff.next()
            self._connect_at = time.monotonic() + delay
            log.warning("no Kafka broker answers at %s (%s; attempt %d): no traces until one does, "
                        "retrying in %.1fs", self.settings.bootstrap_servers, e, self.connect_failures, delay)
            return False
        if self.connect_failures:
            log.warning("connected to Kafka at %s after %d failed attempts", self.settings.bootstrap_servers,
                        self.connect_failures)
        self.connect_failures = 0
        self._backoff.reset()
        return True

    def _build(self):
        """The subscribed consumer and the dead-letter producer (None without dead letters); raises
        when no broker answers within ``bootstrap_timeout_ms``, leaving no client thread behind."""
        from kafka import KafkaConsumer, KafkaProducer
        from kafka.consumer.subscription_state import ConsumerRebalanceListener

        s = self.settings
        servers = s.bootstrap_servers.split(",")
        clients = []  # a constructor that raises leaves its client's IO thread running: closed below

        def tracked(factory):
            def make(**configs):
                client = factory(**configs)
                clients.append(client)
                return client
            return make

        try:
            consumer = KafkaConsumer(
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
                bootstrap_timeout_ms=s.bootstrap_timeout_ms,
                kafka_client=tracked(KafkaConsumer.DEFAULT_CONFIG["kafka_client"]),
            )
            # Not idempotent: a restarted tansu forgets producer ids, which is fatal to kafka-python.
            dlq = KafkaProducer(bootstrap_servers=servers, client_id=f"{s.client_id}-dlq",
                                acks="all", enable_idempotence=False,
                                max_request_size=s.max_partition_fetch_bytes + REQUEST_OVERHEAD_BYTES,
                                max_block_ms=s.dlq_max_block_ms, bootstrap_timeout_ms=s.bootstrap_timeout_ms,
                                kafka_client=tracked(KafkaProducer.DEFAULT_CONFIG["kafka_client"]),
                                ) if s.dead_letter else None
        except BaseException:
            for client in clients:
                try:
                    client.close()
                except Exception:  # the attempt's own error is the one to report
                    log.debug("closing a failed Kafka client", exc_info=True)
            raise
        source = self

        class _DropRevoked(ConsumerRebalanceListener):
            """Uncommitted records of a revoked partition are redelivered to its new owner."""

            def on_partitions_revoked(self, revoked):
                for tp in revoked:
                    source._pending.pop(tp, None)

            def on_partitions_assigned(self, assigned):
                pass

        consumer.subscribe([s.topic], listener=_DropRevoked())
        return consumer, dlq

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def poll(self, max_records: int = 256, timeout: float = 1.0) -> list[TraceRecord]:
        """Up to ``max_records`` valid records, waiting up to ``timeout`` s for the first ones (none
        while no broker answers: see the class)."""
        if not self._connect(timeout):
            self.last_window = {}
            return []
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
        """Every dead letter is on the DLQ topic (resent once if needed) before offsets move on.
        Waits ``dlq_timeout_ms`` at most; after one failed resend (the broker is away) the others
        wait for the next commit."""
        if self._dlq is None or not self._dlq_unconfirmed:
            return True
        from kafka.errors import KafkaTimeoutError

        deadline = time.monotonic() + self.settings.dlq_timeout_ms / 1000
        left = lambda: max(0.0, deadline - time.monotonic())
        try:
            self._dlq.flush(timeout=left())
        except KafkaTimeoutError:
            pass  # what is still in flight stays unconfirmed below
        remaining, away = [], False
        for future, send in self._dlq_unconfirmed:
            if future is not None and future.is_done and future.succeeded():
                continue
            if away or (future is not None and not future.is_done):  # in flight: not sent twice
                remaining.append((future, send))
                continue
            try:
                future = self._send_dead_letter(send)
                future.get(timeout=left())
            except Exception as e:  # noqa: BLE001
                self._dead_letter_failed(e, "not written")
                remaining.append((future, send))
                away = True
        self._dlq_unconfirmed = remaining
        if remaining:
            log.warning("%d dead letters not written: offsets not committed", len(remaining))
        return not remaining

    def _dead_letter_failed(self, error: BaseException, what: str) -> None:
        self.dead_letter_send_failures += 1
        DEAD_LETTER_SEND_FAILURES.inc()
        log.warning("dead letter %s (%s: %s): the next commit retries it", what, type(error).__name__, error)

    def committed(self) -> dict[int, int | None]:
        """Partition -> committed offset of the group (for tests and lag reports)."""
        if self._consumer is None:
            return {}
        return {tp.partition: self._consumer.committed(tp) for tp in self._consumer.assignment()}

    def close(self) -> None:
        """Leave the group without committing (uncommitted records will be delivered again)."""
        self._closed = True
        try:
            if self._dlq is not None:
                self._dlq.close(timeout=5)
        finally:
            if self._consumer is not None:
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
        future = None
        if not any(f is None for f, _ in self._dlq_unconfirmed):  # else the producer is known blocked
            try:
                future = self._send_dead_letter(send)
            except Exception as e:  # noqa: BLE001 - raising here would lose the rest of this poll's batch
                self._dead_letter_failed(e, "not handed to the producer")
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
