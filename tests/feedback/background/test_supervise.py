"""Supervision: background loops that fail are counted, logged, backed off and restarted, and are
reported down while they are (feedback/background/supervise.py); the Kafka sink's sender survives a crash."""

from __future__ import annotations

import threading
import time

from prometheus_client import REGISTRY
from trace_samples import make_trace

from feedback.background.supervise import Backoff, LoopRegistry, SupervisedThread
from feedback.bus.kafka_sink import KafkaTraceSink


def _wait(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def test_a_dead_loop_is_restarted_and_reported_down_meanwhile():
    registry, stop = LoopRegistry(), threading.Event()
    runs, down_seen = [], []
    release = threading.Event()

    def body():
        runs.append(1)
        if len(runs) <= 2:
            raise RuntimeError(f"crash {len(runs)}")
        release.wait()  # third run: healthy until stopped
        stop.wait()

    errors_before = REGISTRY.get_sample_value("specloop_loop_errors_total", {"loop": "unit-loop"}) or 0
    t = SupervisedThread("unit-loop", body, stop, Backoff(initial_s=0.2, max_s=1.0), registry).start()
    assert _wait(lambda: registry.down())
    down_seen.append(registry.down())
    assert "unit-loop" in down_seen[0] and "crash" in down_seen[0]["unit-loop"]["last_error"]
    assert _wait(lambda: len(runs) == 3)
    assert registry.down() == {}
    assert t.status.errors == 2 and t.status.restarts == 2
    errors = REGISTRY.get_sample_value("specloop_loop_errors_total", {"loop": "unit-loop"})
    assert errors - errors_before == 2
    release.set()
    stop.set()
    t.join(5)
    assert not t.is_alive() and registry.snapshot() == {}


def test_backoff_grows_and_is_capped():
    b = Backoff(initial_s=0.5, max_s=3.0)
    assert [b.next() for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    b.reset()
    assert b.next() == 0.5


class _Future:
    def __init__(self):
        self.cb = None

    def add_callback(self, fn, *args):
        fn(*args, None)

    def add_errback(self, fn, *args):
        pass


class _Producer:
    sent = 0

    def send(self, topic, value, key, headers):
        _Producer.sent += 1
        return _Future()

    def close(self, timeout=None):
        pass


def test_sink_sender_that_crashes_is_restarted_and_traces_still_go_out(monkeypatch):
    calls = []

    def make_producer(self):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("unexpected bug in the sender")  # not a Kafka outage: kills _run
        return _Producer()

    monkeypatch.setattr(KafkaTraceSink, "_make_producer", make_producer)
    sink = KafkaTraceSink(bootstrap_servers="127.0.0.1:1", reconnect_backoff_s=0.1, queue_size=64)
    try:
        for i in range(20):
            sink.emit(make_trace(request_id=f"r{i}"))
            time.sleep(0.02)
        assert sink.flush(10)  # a dead sender never drains the queue
        assert sink.sent == 20, (sink.sent, sink.shed_by_reason)
        assert sink._thread.status.errors == 1 and sink._thread.status.restarts == 1
    finally:
        sink.close()


def test_swapper_watcher_errors_are_counted_and_it_recovers(monkeypatch):
    """A Swapper step that raises (e.g. a bug in the champion poll) marks the watcher down with the
    error, backs off, and the watcher goes on (up again once a step passes)."""
    from prometheus_client import CollectorRegistry

    from feedback.background.supervise import LOOPS
    from serving.artifact_loader import ArtifactDrafterLoader
    from serving.drafters.suffix import SuffixDrafter
    from serving.engine.config import EngineConfig
    from serving.engine.torch_engine import TorchEngine
    from serving.live_acceptance import LiveAcceptance
    from serving.swap import SwapConfig, Swapper
    from serving.target import tiny_target

    target = tiny_target(vocab_size=64)
    metrics = CollectorRegistry()
    live = LiveAcceptance(registry=metrics)
    engine = TorchEngine(target, SuffixDrafter(), EngineConfig(max_batch_size=2, k=2), observers=[live])
    swapper = Swapper(engine, ArtifactDrafterLoader(target, "hybrid"), live,
                      config=SwapConfig(poll_interval_s=0.05, log_interval_s=60), metrics_registry=metrics)
    failures = {"left": 2}

    def flaky_poll():
        if failures["left"]:
            failures["left"] -= 1
            raise RuntimeError("champion poll bug")

    monkeypatch.setattr(swapper, "poll_once", flaky_poll)
    swapper.start()
    try:
        status = swapper._thread.status
        status.backoff.initial_s = 0.05
        assert _wait(lambda: status.errors >= 1)
        assert _wait(lambda: status.errors == 2 and status.up)
        assert status.name not in LOOPS.down()
        assert swapper._thread.is_alive()
    finally:
        swapper.stop()
