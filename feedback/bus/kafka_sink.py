"""KafkaTraceSink: traces to the ``specloop.traces`` topic without ever holding up serving.

``emit()`` only appends to a bounded in-memory queue (drop-oldest, like InProcessTraceSink); a
background thread encodes and hands records to a kafka-python producer. A broker outage fills the
queue and sheds traces (counted), never requests. The producer is rebuilt when it cannot recover
by itself (an idempotent producer whose producer id the restarted broker has forgotten).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Literal, Self

from prometheus_client import Counter
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from feedback.background.supervise import Backoff, SupervisedThread
from feedback.bus.codec import CODEC_MAJOR, CODEC_MINOR, encode
from feedback.bus.trace import TraceRecord

log = logging.getLogger(__name__)

TRACES_SENT = Counter("specloop_traces_sent_total", "Traces acknowledged by the broker.")
TRACES_SHED = Counter(
    "specloop_traces_shed_total",
    "Traces dropped before reaching the broker (the request itself was served).",
    ["reason"],
)
TRACE_BYTES = Counter("specloop_trace_bytes_total", "Encoded bytes of acknowledged traces.")

SHED_REASONS = ("queue_full", "broker_unavailable", "delivery_failed", "too_large", "invalid",
                "closed")
TRACE_CONTENT_TYPE = f"application/x-specloop-trace; v={CODEC_MAJOR}.{CODEC_MINOR}".encode()
REQUEST_OVERHEAD_BYTES = 64 << 10
"""What a produce request carries beside one message's bytes (record batch, key, headers): the
trace sink's and the dead-letter producer's (kafka_source.py) requests allow for it. A broker must
accept ``max_message_bytes`` plus this (Apache Kafka's ``message.max.bytes``; compose sets it)."""


class KafkaSinkSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECLOOP_KAFKA_")

    bootstrap_servers: str = Field("127.0.0.1:9092", description="Comma-separated host:port list.")
    topic: str = Field("specloop.traces", description="Trace topic; messages are keyed by tenant.")
    queue_size: int = Field(1024, ge=1, description="Records waiting for the sender thread; "
                                                     "when full the oldest is shed.")
    max_in_flight: int = Field(256, ge=1, description="Records handed to the producer and not yet "
                                                       "acknowledged; bounds memory in an outage.")
    compression: Literal["auto", "gzip", "lz4", "zstd", "snappy", "none"] = Field(
        "auto", description="Kafka batch compression; auto = lz4 if installed, else gzip.")
    idempotence: bool = Field(True, description="Idempotent producer (no duplicates on retry).")
    linger_ms: int = Field(20, description="Batching delay of the producer.")
    request_timeout_ms: int = Field(5_000, description="Per produce request.")
    delivery_timeout_ms: int = Field(10_000, description="After this a trace counts as shed.")
    max_block_ms: int = Field(1_000, description="Longest the sender thread waits for metadata.")
    bootstrap_timeout_ms: int = Field(2_000, description="Connecting a new producer.")
    reconnect_backoff_s: float = Field(1.0, description="Wait between producer (re)creations.")
    max_message_bytes: int = Field(4 << 20, description="Larger encoded traces are shed.")
    close_timeout_s: float = Field(5.0, ge=0.0, description="At close (serving's shutdown), how long "
                                   "queued traces may still be sent; the rest is shed as `closed`.")
    client_id: str = Field("specloop-serving", description="Kafka client id.")


class KafkaTraceSink:
    """TraceSink to Kafka. ``emit`` costs a lock and a deque append; it never blocks or raises.

    Counters (plain ints on the instance, Prometheus in the process registry)::

        emitted == sent + shed + pending      # pending = queued + in flight; 0 after close()

    PromQL, fraction of traces lost on the way to the trainer::

        sum(rate(specloop_traces_shed_total[5m]))
          / (sum(rate(specloop_traces_sent_total[5m])) + sum(rate(specloop_traces_shed_total[5m])))
    """

    def __init__(self, settings: KafkaSinkSettings | None = None, **overrides):
        self.settings = (settings or KafkaSinkSettings()).model_copy(update=overrides)
        self.emitted = 0
        self.sent = 0
        self.shed = 0
        self.sent_bytes = 0
        self.shed_by_reason: dict[str, int] = dict.fromkeys(SHED_REASONS, 0)
        self.producer_resets = 0
        self.idempotent: bool | None = None  # known once a producer exists
        self._queue: collections.deque[TraceRecord] = collections.deque()
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._closing = threading.Event()
        self._closed = False
        self._abandoned = False  # close() counted what was left: late callbacks count nothing
        self._in_flight = 0
        self._use_idempotence = self.settings.idempotence
        self._producer = None
        self._generation = 0  # bumped per producer, so a dead producer's errors are not counted
        self._fatal_streak = 0
        self._delivered_by_producer = 0
        self._outage = False  # logged once per outage
        # supervised: a sender that dies is counted, logged and restarted (else every later trace
        # would be shed as queue_full); /health reports it down meanwhile
        self._thread = SupervisedThread(
            "kafka-trace-sink", self._run, self._closing,
            Backoff(initial_s=min(0.5, self.settings.reconnect_backoff_s), max_s=30.0)).start()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- serving side -------------------------------------------------------------------------

    def emit(self, record: TraceRecord) -> None:
        """Queue ``record`` (the sink owns it now: do not mutate its arrays afterwards)."""
        try:
            with self._lock:
                self.emitted += 1
                if self._closed:
                    self._count_shed_locked("closed")
                    return
                if len(self._queue) >= self.settings.queue_size:
                    self._queue.popleft()
                    self._count_shed_locked("queue_full")
                self._queue.append(record)
            self._wakeup.set()
        except Exception:
            log.exception("trace sink emit failed")

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._queue) + self._in_flight

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every emitted trace was sent or shed. True if that happened in time."""
        deadline = time.monotonic() + timeout
        while self.pending:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def close(self, timeout: float | None = None) -> None:
        """Send what can be sent within ``timeout`` (default: the settings' ``close_timeout_s``,
        env SPECLOOP_KAFKA_CLOSE_TIMEOUT_S); the rest (queued, or held by the producer for
        a broker that does not answer) is shed as ``closed``, counted and logged: afterwards
        ``pending == 0`` and ``emitted == sent + shed``."""
        if self._closed:
            return
        timeout = self.settings.close_timeout_s if timeout is None else timeout
        with self._lock:
            self._closed = True
            closed_before = self.shed_by_reason.get("closed", 0)
        self.flush(timeout)
        self._closing.set()
        self._wakeup.set()
        self._thread.join(timeout=max(1.0, timeout))
        self._drop_producer(timeout=0.5)  # aborts its unfinished batches: errbacks count them
        with self._lock:
            while self._queue:
                self._queue.popleft()
                self._count_shed_locked("closed")
            for _ in range(self._in_flight):  # callbacks that never came (or not yet): ours now
                self._count_shed_locked("closed")
            self._in_flight = 0
            self._abandoned = True
            unsent = self.shed_by_reason.get("closed", 0) - closed_before
        if unsent:
            log.warning("kafka trace sink closed with %d trace(s) unsent (shed as 'closed'; "
                        "%d sent, %d shed in all)", unsent, self.sent, self.shed)

    # ---- sender thread ------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._closing.is_set():
            with self._lock:
                has_work = bool(self._queue)
                full = self._in_flight >= self.settings.max_in_flight
            if not has_work or full:
                self._wakeup.wait(0.05 if not full else 0.005)
                self._wakeup.clear()
                continue
            producer = self._ensure_producer()
            if producer is None:
                self._closing.wait(self.settings.reconnect_backoff_s)
                continue
            with self._lock:
                record = self._queue.popleft() if self._queue else None
                if record is not None:
                    self._in_flight += 1
            if record is not None:
                self._send(producer, record)

    def _send(self, producer, record: TraceRecord) -> None:
        from kafka.errors import KafkaTimeoutError

        try:
            value = encode(record)
        except Exception as e:  # noqa: BLE001
            log.warning("trace %s not encodable: %s", getattr(record, "request_id", "?"), e)
            return self._settle("invalid")
        if len(value) > self.settings.max_message_bytes:
            return self._settle("too_large")
        try:
            future = producer.send(
                self.settings.topic, value=value, key=record.tenant.encode(),
                headers=[("content-type", TRACE_CONTENT_TYPE),
                         ("request-id", record.request_id.encode())],
            )
        except KafkaTimeoutError:  # no metadata within max_block_ms: broker unreachable
            return self._settle("broker_unavailable")
        except Exception as e:  # noqa: BLE001
            log.warning("producer.send failed (%s); rebuilding the producer", e)
            self._drop_producer(timeout=0)
            return self._settle("broker_unavailable")
        # kafka-python calls f(*args, result): our arguments come first.
        future.add_callback(self._on_delivered, len(value), self._generation)
        future.add_errback(self._on_failed, self._generation)

    def _on_delivered(self, nbytes: int, generation: int, _metadata) -> None:
        with self._lock:
            if self._abandoned:  # close() already counted it as shed
                return
            if generation == self._generation:
                self._fatal_streak = 0
                self._delivered_by_producer += 1
            self._in_flight -= 1
            self.sent += 1
            self.sent_bytes += nbytes
        TRACES_SENT.inc()
        TRACE_BYTES.inc(nbytes)

    def _on_failed(self, generation: int, error: Exception) -> None:
        from kafka.errors import KafkaTimeoutError

        if generation == self._generation and not isinstance(error, KafkaTimeoutError):
            self._fatal_streak += 1  # the broker answered with an error: maybe a stale producer id
        self._settle("closed" if self._closing.is_set() else "delivery_failed")

    def _settle(self, reason: str) -> None:
        """A record taken off the queue ends as shed."""
        with self._lock:
            if self._abandoned:  # close() already counted it
                return
            self._in_flight -= 1
            self._count_shed_locked(reason)

    def _count_shed(self, reason: str) -> None:
        with self._lock:
            self._count_shed_locked(reason)

    def _count_shed_locked(self, reason: str) -> None:
        self.shed += 1
        self.shed_by_reason[reason] = self.shed_by_reason.get(reason, 0) + 1
        TRACES_SHED.labels(reason=reason).inc()

    # ---- producer lifecycle -------------------------------------------------------------------

    def _ensure_producer(self):
        if self._producer is not None and self._producer_broken():
            if self.idempotent and self._delivered_by_producer == 0:
                log.warning("idempotent kafka producer failed before any delivery: the broker "
                            "may not support idempotence; falling back to a plain producer")
                self._use_idempotence = False
            else:
                log.warning("kafka producer is in a fatal state; rebuilding it")
            self.producer_resets += 1
            self._drop_producer(timeout=0)
        if self._producer is None:
            producer = self._make_producer()
            if producer is not None and self._closing.is_set():  # close() gave up waiting on us
                producer.close(timeout=0)
                return None
            self._producer = producer
        return self._producer

    def _producer_broken(self) -> bool:
        # kafka-python keeps an idempotent producer's fatal InitProducerId error forever; tansu
        # with memory storage forgets producer ids on restart, which triggers exactly that.
        tm = getattr(self._producer, "_transaction_manager", None)
        fatal = tm is not None and getattr(tm, "has_fatal_error", lambda: False)()
        return fatal or self._fatal_streak >= 3

    def _make_producer(self):
        from kafka import KafkaProducer

        s = self.settings
        config = {
            "bootstrap_servers": s.bootstrap_servers.split(","),
            "client_id": s.client_id,
            "acks": "all",
            "compression_type": self._compression(),
            "linger_ms": s.linger_ms,
            "request_timeout_ms": s.request_timeout_ms,
            "delivery_timeout_ms": max(s.delivery_timeout_ms, s.linger_ms + s.request_timeout_ms),
            "max_block_ms": s.max_block_ms,
            "bootstrap_timeout_ms": s.bootstrap_timeout_ms,
            "max_request_size": s.max_message_bytes + REQUEST_OVERHEAD_BYTES,
            "reconnect_backoff_max_ms": int(s.reconnect_backoff_s * 1000),
        }
        try:
            producer = KafkaProducer(enable_idempotence=self._use_idempotence, **config)
        except Exception as e:  # noqa: BLE001 - KafkaError mostly; anything else is the same outage
            level = logging.DEBUG if self._outage else logging.WARNING
            log.log(level, "kafka producer unavailable (%s): traces are queued, then shed", e)
            self._outage = True
            return None
        if self._outage:
            log.warning("kafka producer connected again to %s", s.bootstrap_servers)
            self._outage = False
        with self._lock:
            self._generation += 1
            self._fatal_streak = 0
            self._delivered_by_producer = 0
        self.idempotent = self._use_idempotence
        return producer

    def _drop_producer(self, timeout: float) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            try:
                producer.close(timeout=timeout)  # aborts what is left: errbacks count it as shed
            except Exception as e:  # noqa: BLE001
                # kafka-python's close() flushes first and raises when that times out, before it
                # stops its sender: the unfinished batches would then neither be sent nor fail
                # (no errback, never counted). Stop the sender so that it aborts them.
                log.warning("kafka producer did not close cleanly (%s); aborting its unsent "
                            "traces", e)
                self._force_close(producer, timeout)

    @staticmethod
    def _force_close(producer, timeout: float) -> None:
        try:
            sender = producer._sender  # kafka-python's I/O thread
            sender.force_close()  # it fails every incomplete batch (errbacks run), then exits
            if timeout > 0 and sender is not threading.current_thread():
                sender.join(timeout)
            producer.close(timeout=0)  # nothing left to flush now: the rest of its cleanup
        except Exception as e:  # noqa: BLE001 - close() counts whatever is still in flight
            log.debug("force-closing kafka producer: %s", e)

    def _compression(self) -> str | None:
        from kafka import codec

        choice = self.settings.compression
        if choice == "auto":
            return "lz4" if codec.has_lz4() else "gzip"
        return None if choice == "none" else choice
