"""Trace transport on a real tansu broker: sink -> topic -> source, outages, DLQ, restarts."""

from __future__ import annotations

import statistics
import time

import pytest
from trace_samples import assert_same_trace, make_trace

from feedback.bus.codec import encode
from feedback.bus.kafka_sink import KafkaTraceSink
from feedback.bus.kafka_source import KafkaTraceSource
from infra.stack import free_port

FAST_GROUP = {"session_timeout_ms": 2_000, "heartbeat_interval_ms": 500}


def fast_sink(bootstrap: str, topic: str, **kw) -> KafkaTraceSink:
    """Short timeouts so outages are detected and recovered from within a test's time."""
    config = {"linger_ms": 5, "request_timeout_ms": 2_000, "delivery_timeout_ms": 3_000,
              "max_block_ms": 500, "bootstrap_timeout_ms": 1_000, "reconnect_backoff_s": 0.3}
    return KafkaTraceSink(bootstrap_servers=bootstrap, topic=topic, **{**config, **kw})


def fast_source(bootstrap: str, topic: str, group: str = "trainer", **kw) -> KafkaTraceSource:
    return KafkaTraceSource(bootstrap_servers=bootstrap, topic=topic, dlq_topic=f"{topic}.dlq",
                            group_id=group, **FAST_GROUP, **kw)


def poll_until(source: KafkaTraceSource, n: int, timeout: float = 20.0, max_records: int = 256):
    got, deadline = [], time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        got += source.poll(max_records=min(max_records, n - len(got)), timeout=0.5)
    return got


def read_raw(bootstrap: str, topic: str, n: int, timeout: float = 10.0):
    """Every message of ``topic`` with key and headers, without a consumer group."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    try:
        deadline = time.monotonic() + timeout
        parts = None
        while not parts and time.monotonic() < deadline:
            parts = consumer.partitions_for_topic(topic)
            time.sleep(0.1)
        assert parts, f"topic {topic} never appeared"
        consumer.assign([TopicPartition(topic, p) for p in parts])
        consumer.seek_to_beginning()
        out = []
        while len(out) < n and time.monotonic() < deadline:
            for msgs in consumer.poll(timeout_ms=300).values():
                out += msgs
        return out
    finally:
        consumer.close()


def raw_producer(bootstrap: str):
    from kafka import KafkaProducer

    return KafkaProducer(bootstrap_servers=bootstrap, acks="all")


@pytest.mark.integration
def test_sink_to_source_delivers_records_intact(kafka_broker, kafka_topic):
    records = [make_trace(num_steps=10 + i, k=4, topk=8, seed=i, with_hidden=i % 3 == 0,
                          tenant=("acme", "globex")[i % 2]) for i in range(24)]
    sink = fast_sink(kafka_broker.url, kafka_topic)
    for r in records:
        sink.emit(r)
    assert sink.flush(15)
    assert (sink.sent, sink.shed) == (24, 0)
    assert sink.idempotent is True  # tansu 0.6 grants producer ids
    sink.close()

    source = fast_source(kafka_broker.url, kafka_topic)
    try:
        got = poll_until(source, 24)
        assert source.commit()
    finally:
        source.close()
    by_id = {r.request_id: r for r in got}
    assert len(got) == 24 and set(by_id) == {r.request_id for r in records}
    for r in records:
        assert_same_trace(r, by_id[r.request_id])

    raw = read_raw(kafka_broker.url, kafka_topic, 24)
    assert sorted(m.key for m in raw) == sorted(r.tenant.encode() for r in records)
    parts = {m.key: set() for m in raw}
    for m in raw:
        parts[m.key].add(m.partition)
    assert all(len(p) == 1 for p in parts.values())  # keyed by tenant: one partition per tenant
    assert all(dict(m.headers)["content-type"].startswith(b"application/x-specloop-trace")
               for m in raw)


@pytest.mark.integration
def test_sink_throughput_and_bytes_per_trace(kafka_broker, kafka_topic, record_property):
    # ~96-token answers: 70 verify steps, k=4, top-20 of the target.
    records = [make_trace(num_steps=70, k=4, topk=20, seed=i) for i in range(20)]
    n = 400
    sink = fast_sink(kafka_broker.url, kafka_topic, queue_size=n, delivery_timeout_ms=60_000,
                     request_timeout_ms=30_000)
    sink.emit(records[0])
    assert sink.flush(10)  # connected, topic created
    t0 = time.perf_counter()
    emit_times = []
    for i in range(n):
        t = time.perf_counter()
        sink.emit(records[i % len(records)])
        emit_times.append(time.perf_counter() - t)
    assert sink.flush(60)
    elapsed = time.perf_counter() - t0
    sink.close()
    assert sink.shed == 0 and sink.sent == n + 1
    per_s = n / elapsed
    bytes_per_trace = sink.sent_bytes / sink.sent
    record_property("traces_per_s", round(per_s, 1))
    record_property("bytes_per_trace", round(bytes_per_trace))
    print(f"\nsink: {per_s:.0f} traces/s, {bytes_per_trace:.0f} B/trace, "
          f"emit p50 {statistics.median(emit_times) * 1e6:.1f} us")
    assert per_s > 20
    assert statistics.median(emit_times) < 1e-3


@pytest.mark.integration
@pytest.mark.usefixtures("requires_tansu")
def test_broker_down_sheds_without_blocking_and_export_resumes(private_stack, kafka_topic):
    broker = private_stack.start_broker()
    sink = fast_sink(broker.url, kafka_topic, queue_size=16, max_in_flight=32)
    records = [make_trace(num_steps=12, seed=i) for i in range(10)]
    for r in records:
        sink.emit(r)
    assert sink.flush(10) and sink.sent == 10

    private_stack.stop("broker")
    worst = 0.0
    for i in range(200):
        t = time.perf_counter()
        sink.emit(records[i % 10])
        worst = max(worst, time.perf_counter() - t)
        time.sleep(0.01)
    assert worst < 0.05, f"emit blocked for {worst * 1e3:.1f} ms while the broker was down"
    assert sink.shed > 0
    sent_during_outage = sink.sent
    assert sent_during_outage == 10

    private_stack.start_broker(port=broker.port)  # memory storage: the topic comes back empty
    deadline = time.monotonic() + 30
    while sink.sent < sent_during_outage + 5 and time.monotonic() < deadline:
        sink.emit(records[0])
        time.sleep(0.05)
    assert sink.sent >= sent_during_outage + 5, sink.shed_by_reason
    assert sink.flush(10)
    sink.close()
    assert sink.emitted == sink.sent + sink.shed  # every trace accounted for

    source = fast_source(broker.url, kafka_topic)
    try:
        assert len(poll_until(source, 5)) >= 5  # what was sent after the restart is consumable
    finally:
        source.close()


def test_sink_without_any_broker_never_raises_and_counts_everything():
    sink = fast_sink(f"127.0.0.1:{free_port()}", "nowhere", queue_size=4)
    t = time.perf_counter()
    for i in range(50):
        sink.emit(make_trace(num_steps=3, seed=i))
    assert time.perf_counter() - t < 0.5
    sink.close(timeout=0.5)
    assert sink.sent == 0 and sink.shed == sink.emitted == 50
    assert sink.shed_by_reason["queue_full"] == 46
    sink.emit(make_trace(seed=1))  # after close: shed, no error
    assert sink.shed_by_reason["closed"] == 5


@pytest.mark.integration
def test_malformed_messages_are_dead_lettered_and_consumption_continues(kafka_broker, kafka_topic):
    good = [make_trace(num_steps=6, seed=i) for i in range(3)]
    truncated = encode(make_trace(seed=9))[:-7]
    bad = [b"\x00garbage", truncated]
    producer = raw_producer(kafka_broker.url)
    for value in (encode(good[0]), bad[0], encode(good[1]), bad[1], encode(good[2])):
        producer.send(kafka_topic, key=b"t", value=value, headers=[("origin", b"test")])
    producer.flush()
    producer.close()

    source = fast_source(kafka_broker.url, kafka_topic)
    try:
        got = poll_until(source, 3)
        assert [r.request_id for r in got] == [r.request_id for r in good]
        assert source.dead_lettered == 2
        assert source.commit()
    finally:
        source.close()

    dead = read_raw(kafka_broker.url, f"{kafka_topic}.dlq", 2)
    assert sorted(m.value for m in dead) == sorted(bad)
    for m in dead:
        headers = dict(m.headers)
        assert headers["specloop-error-type"] == b"TraceDecodeError"
        assert headers["specloop-source"].startswith(f"{kafka_topic}/".encode())
        assert headers["origin"] == b"test"  # original headers are kept
        assert m.key == b"t"


@pytest.mark.integration
def test_a_reader_without_dead_letters_skips_bad_messages_and_writes_none(kafka_broker, kafka_topic):
    """Replicas' followers read the topic too: only the trainer dead-letters a bad message, so the
    dead-letter topic holds it once, not once per reader."""
    good = [make_trace(num_steps=6, seed=i) for i in range(2)]
    producer = raw_producer(kafka_broker.url)
    for value in (encode(good[0]), b"\x00garbage", encode(good[1])):
        producer.send(kafka_topic, key=b"t", value=value)
    producer.flush()
    producer.close()

    follower = fast_source(kafka_broker.url, kafka_topic, group="replica", dead_letter=False)
    trainer = fast_source(kafka_broker.url, kafka_topic)
    try:
        got = poll_until(follower, 2)
        assert [r.request_id for r in got] == [r.request_id for r in good]
        assert (follower.skipped_undecodable, follower.dead_lettered) == (1, 0)
        assert follower.commit()
        assert len(poll_until(trainer, 2)) == 2 and trainer.dead_lettered == 1
        assert trainer.commit()
    finally:
        follower.close()
        trainer.close()
    assert len(read_raw(kafka_broker.url, f"{kafka_topic}.dlq", 2, timeout=5)) == 1


@pytest.mark.integration
def test_restarted_consumer_resumes_from_committed_offsets(kafka_broker, kafka_topic):
    records = [make_trace(num_steps=4, seed=100 + i, tenant=f"t{i % 3}") for i in range(30)]
    sink = fast_sink(kafka_broker.url, kafka_topic)
    for r in records:
        sink.emit(r)
    assert sink.flush(10) and sink.sent == 30
    sink.close()

    first = fast_source(kafka_broker.url, kafka_topic, group="resume")
    try:
        committed_batch = poll_until(first, 8, max_records=8)
        assert len(committed_batch) == 8 and first.commit()
        uncommitted_batch = poll_until(first, 7, max_records=7)
        assert len(uncommitted_batch) == 7
    finally:
        first.close()  # crash-like: the second batch was never committed

    second = fast_source(kafka_broker.url, kafka_topic, group="resume")
    try:
        rest = poll_until(second, 22, timeout=20)
        assert second.poll(timeout=1.0) == []  # and nothing beyond that
        assert second.commit()
        assert sum(o or 0 for o in second.committed().values()) == 30
    finally:
        second.close()
    ids = lambda rs: {r.request_id for r in rs}
    assert ids(rest) & ids(committed_batch) == set()  # committed work is not replayed
    assert ids(uncommitted_batch) <= ids(rest)  # the uncommitted batch is replayed
    assert ids(rest) | ids(committed_batch) == ids(records)  # nothing lost
    assert len(rest) == 22  # no duplicates beyond the uncommitted batch


@pytest.mark.integration
def test_poisoned_traces_are_dead_lettered_with_their_reason(kafka_broker, kafka_topic):
    from trace_samples import POISONED, poisoned_trace

    from feedback.bus.kafka_source import TRACES_DEAD_LETTERED

    def dead_lettered() -> float:
        return TRACES_DEAD_LETTERED.labels(error_type="TraceDecodeError")._value.get()

    good = [make_trace(num_steps=6, seed=200 + i) for i in range(2)]
    values = [encode(good[0]), *(encode(poisoned_trace(name)) for name in POISONED), encode(good[1])]
    producer = raw_producer(kafka_broker.url)
    for value in values:
        producer.send(kafka_topic, key=b"t", value=value)
    producer.flush()
    producer.close()

    before = dead_lettered()
    source = fast_source(kafka_broker.url, kafka_topic)
    try:
        got = poll_until(source, 2)
        assert [r.request_id for r in got] == [r.request_id for r in good]
        assert source.dead_lettered == len(POISONED)
        assert source.commit()
        assert sum(o or 0 for o in source.committed().values()) == len(values)
    finally:
        source.close()
    assert dead_lettered() - before == len(POISONED)

    dead = read_raw(kafka_broker.url, f"{kafka_topic}.dlq", len(POISONED))
    assert sorted(m.value for m in dead) == sorted(values[1:-1])  # the original bytes
    reasons = [dict(m.headers)["specloop-error"].decode() for m in dead]
    assert any("NaN" in r for r in reasons) and any("positions" in r for r in reasons), reasons


@pytest.mark.integration
def test_oversized_undecodable_messages_lose_none_of_their_neighbours(kafka_broker, kafka_topic):
    """Messages over the consumer's fetch limit are still fetched (each is first in its batch). A
    dead letter a little over it keeps its bytes; one too large for the dead-letter producer goes
    without them (they stay at ``specloop-source``); the records polled with either are returned."""
    from kafka import KafkaProducer

    limit = 64 << 10
    good = [make_trace(num_steps=4, seed=300 + i) for i in range(3)]
    near, far = b"\x01" * (limit + 1000), b"\x02" * (4 * limit)
    values = (encode(good[0]), near, encode(good[1]), far, encode(good[2]))
    producer = KafkaProducer(bootstrap_servers=kafka_broker.url, acks="all", max_request_size=1 << 20)
    for value in values:
        producer.send(kafka_topic, key=b"t", value=value)
    producer.flush()
    producer.close()

    source = fast_source(kafka_broker.url, kafka_topic, max_partition_fetch_bytes=limit)
    try:
        got = poll_until(source, 3, max_records=10)
        assert [r.request_id for r in got] == [r.request_id for r in good]
        assert source.dead_lettered == 2
        assert source.commit()
        assert sum(o or 0 for o in source.committed().values()) == len(values)
    finally:
        source.close()
    dead = {dict(m.headers)["specloop-source"].decode().rpartition("/")[2]: m
            for m in read_raw(kafka_broker.url, f"{kafka_topic}.dlq", 2)}
    assert dead["1"].value == near and "specloop-value-omitted" not in dict(dead["1"].headers)
    headers = dict(dead["3"].headers)
    assert dead["3"].value == b"" and headers["specloop-value-omitted"] == str(len(far)).encode()
    assert headers["specloop-error-type"] == b"TraceDecodeError"


@pytest.mark.integration
def test_a_long_answers_trace_over_a_mebibyte_arrives_intact(kafka_broker, kafka_topic):
    """~330 B a token: a 6k-token answer's trace is ~2 MB, over Kafka's default message limit (the
    compose broker raises it: tests/infra/test_compose.py). It must not be shed on the way."""
    long, short = make_trace(num_steps=3000, k=4, topk=20, seed=7), make_trace(num_steps=8, seed=8)
    assert len(encode(long)) > 1 << 20
    sink = fast_sink(kafka_broker.url, kafka_topic)
    sink.emit(long)
    sink.emit(short)
    assert sink.flush(15)
    assert (sink.sent, sink.shed) == (2, 0)
    sink.close()
    source = fast_source(kafka_broker.url, kafka_topic)
    try:
        got = {r.request_id: r for r in poll_until(source, 2)}
    finally:
        source.close()
    assert set(got) == {long.request_id, short.request_id}
    assert_same_trace(long, got[long.request_id])
