"""The trainer's source when its broker is away: built at once, polls nothing (warning, capped
back-off) until a broker answers, then consumes and commits; dead letters never stall it."""

from __future__ import annotations

import logging
import threading
import time
from types import SimpleNamespace

import pytest
from trace_samples import make_trace

from feedback.bus.codec import encode
from feedback.bus.kafka_source import KafkaTraceSource
from infra.stack import free_port

FAST_GROUP = {"session_timeout_ms": 2_000, "heartbeat_interval_ms": 500}


def kafka_io_threads() -> int:
    return sum(t.name.startswith("kafka-io") for t in threading.enumerate())


def poll_until(source: KafkaTraceSource, n: int, timeout: float = 20.0) -> list:
    got, deadline = [], time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        got += source.poll(max_records=n - len(got), timeout=0.5)
    return got


def test_a_source_without_a_broker_is_built_at_once_and_polls_nothing(caplog):
    threads = kafka_io_threads()
    t = time.monotonic()
    source = KafkaTraceSource(bootstrap_servers=f"127.0.0.1:{free_port()}", topic="nowhere",
                              bootstrap_timeout_ms=300, reconnect_backoff_max_s=0.4)
    assert time.monotonic() - t < 1.0  # was: ~30 s, then NoBrokersAvailable / KafkaTimeoutError
    try:
        with caplog.at_level(logging.WARNING, logger="feedback.bus.kafka_source"):
            t = time.monotonic()
            for _ in range(6):
                assert source.poll(timeout=0.2) == []
            elapsed = time.monotonic() - t
        assert not source.connected and source.connect_failures >= 2  # it went on trying
        assert elapsed < 6 * (0.2 + 0.3) + 1.0  # each poll: its timeout, at most one attempt more
        assert any("no Kafka broker" in r.getMessage() for r in caplog.records)
        assert source.commit() is True  # nothing was polled: nothing left uncommitted
        assert source.committed() == {}
        assert kafka_io_threads() == threads  # a failed attempt leaves no client thread behind
    finally:
        source.close()
    assert source.poll(timeout=0.05) == []  # closed: never connects again


def test_the_back_off_doubles_up_to_its_cap():
    source = KafkaTraceSource(bootstrap_servers=f"127.0.0.1:{free_port()}", topic="nowhere",
                              bootstrap_timeout_ms=100, reconnect_backoff_max_s=30.0)
    try:
        delays = []
        for _ in range(9):
            source._connect_at = 0.0  # due now: one attempt per poll
            source.poll(timeout=0.0)
            delays.append(round(source._connect_at - time.monotonic()))
        assert delays[-1] == 30 and delays == sorted(delays), delays  # capped exponential back-off
        assert source.connect_failures == 9
    finally:
        source.close()


@pytest.mark.integration
@pytest.mark.usefixtures("requires_tansu")
def test_a_source_started_before_its_broker_consumes_and_commits_once_it_is_up(private_stack, kafka_topic):
    port = free_port()
    source = KafkaTraceSource(bootstrap_servers=f"127.0.0.1:{port}", topic=kafka_topic,
                              dlq_topic=f"{kafka_topic}.dlq", group_id="late-broker",
                              bootstrap_timeout_ms=500, reconnect_backoff_max_s=1.0, **FAST_GROUP)
    try:
        assert source.poll(timeout=0.2) == [] and not source.connected
        broker = private_stack.start_broker(port=port)
        from kafka import KafkaProducer

        good = [make_trace(num_steps=5, seed=400 + i) for i in range(4)]
        producer = KafkaProducer(bootstrap_servers=broker.url, acks="all")
        for value in (encode(good[0]), encode(good[1]), b"\x00garbage", encode(good[2]), encode(good[3])):
            producer.send(kafka_topic, key=b"t", value=value)
        producer.flush()
        producer.close()

        got = poll_until(source, 4)
        assert source.connected
        assert sorted(r.request_id for r in got) == sorted(r.request_id for r in good)
        assert source.dead_lettered == 1  # the dead-letter producer was built with the consumer
        assert source.commit()
        assert sum(o or 0 for o in source.committed().values()) == 5
    finally:
        source.close()


@pytest.mark.integration
@pytest.mark.usefixtures("requires_tansu")
def test_a_dead_letter_while_the_broker_is_away_is_counted_not_waited_for(private_stack, kafka_topic):
    """The dead-letter producer blocks for at most ``dlq_max_block_ms`` (kafka-python's default
    max_block_ms is 60 s): dead-lettering and committing during an outage return within seconds."""
    broker = private_stack.start_broker()
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=broker.url, acks="all")
    producer.send(kafka_topic, key=b"t", value=encode(make_trace(num_steps=5, seed=500)))
    producer.flush()
    producer.close()

    source = KafkaTraceSource(bootstrap_servers=broker.url, topic=kafka_topic, dlq_topic=f"{kafka_topic}.dlq",
                              group_id="dlq-outage", dlq_max_block_ms=1_000, dlq_timeout_ms=2_000, **FAST_GROUP)
    try:
        assert len(poll_until(source, 1)) == 1  # connected, one record awaits its commit
        private_stack.stop("broker")
        # a message fetched just before the broker went (a poll hands it on as fetched)
        fetched = SimpleNamespace(topic=kafka_topic, partition=0, offset=1, key=b"t", value=b"\x00garbage",
                                  headers=[])
        t = time.monotonic()
        assert source._decode_or_dead_letter(fetched) is None and source.dead_lettered == 1
        assert time.monotonic() - t < 3, "dead-lettering waited on the producer while the broker was away"
        assert source.dead_letter_send_failures == 1  # counted (and logged), retried by the commit
        t = time.monotonic()
        assert source.commit() is False  # the dead letter is not written: offsets stay put
        assert time.monotonic() - t < 6, "a commit waited on the dead-letter producer"
        assert source.dead_letter_send_failures == 2
    finally:
        source.close()
