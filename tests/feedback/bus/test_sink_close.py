"""KafkaTraceSink.close(): every trace emitted before it ends sent or counted as shed ("closed"),
also those the producer holds for a broker that is gone (kafka-python's close() raises on them)."""

from __future__ import annotations

import logging
import time

import pytest
from prometheus_client import REGISTRY
from trace_samples import make_trace

from feedback.bus.kafka_sink import KafkaTraceSink


def _closed_metric() -> float:
    return REGISTRY.get_sample_value("specloop_traces_shed_total", {"reason": "closed"}) or 0.0


@pytest.mark.integration
@pytest.mark.usefixtures("requires_tansu")
def test_close_with_the_broker_gone_counts_every_unsent_trace_as_closed(private_stack, kafka_topic, caplog):
    broker = private_stack.start_broker()
    # long delivery timeouts: the producer still holds the traces when close() comes
    sink = KafkaTraceSink(bootstrap_servers=broker.url, topic=kafka_topic, linger_ms=5,
                          request_timeout_ms=30_000, delivery_timeout_ms=60_000, max_block_ms=500,
                          bootstrap_timeout_ms=1_000, reconnect_backoff_s=0.3, close_timeout_s=1.0)
    for i in range(5):
        sink.emit(make_trace(num_steps=4, seed=i))
    assert sink.flush(20) and sink.sent == 5

    private_stack.stop("broker")
    for i in range(20):
        sink.emit(make_trace(num_steps=4, seed=100 + i))
    deadline = time.monotonic() + 10
    while sink.pending and sink._queue and time.monotonic() < deadline:  # handed to the producer
        time.sleep(0.01)
    assert sink.pending == 20

    before = _closed_metric()
    caplog.set_level(logging.WARNING, logger="feedback.bus.kafka_sink")
    t = time.monotonic()
    sink.close()  # within its close_timeout_s (SPECLOOP_KAFKA_CLOSE_TIMEOUT_S), not the 5 s default
    assert time.monotonic() - t < 4.5  # ~1.5 s here; the 5 s default alone would exceed it
    assert sink.pending == 0
    assert sink.emitted == sink.sent + sink.shed == 25  # none vanished
    assert sink.sent == 5 and sink.shed_by_reason["closed"] == 20, sink.shed_by_reason
    assert _closed_metric() - before == 20
    assert any("20" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records), \
        [r.getMessage() for r in caplog.records]
    time.sleep(0.5)  # nothing is counted twice later (a late errback of the aborted producer)
    assert sink.emitted == sink.sent + sink.shed == 25
