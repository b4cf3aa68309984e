"""Replicas share what their suffix indexes learn (issue 14): a prompt family served only on replica
A raises replica B's acceptance on it, through the real broker."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from feedback.bus.kafka_sink import KafkaTraceSink
from feedback.bus.kafka_source import KafkaTraceSource
from serving.drafters.suffix import SuffixDrafter, suffix_part
from serving.engine.base import GenerationRequest, SamplingParams
from serving.engine.config import EngineConfig
from serving.engine.torch_engine import TorchEngine
from serving.observers import TraceRecorder
from serving.target import tiny_target
from serving.trace_follow import TraceFollower

pytestmark = pytest.mark.integration


def _family(i: int) -> list[int]:
    return [5, 9, 13, 17, 21, 25, 29, 3 + i % 3]  # one prompt family: a shared stem


def test_family_served_on_replica_a_raises_replica_b_acceptance(kafka_broker, kafka_topic, run):
    target = tiny_target(vocab_size=48, hidden_size=64, num_layers=2)
    sink = KafkaTraceSink(bootstrap_servers=kafka_broker.url, topic=kafka_topic)
    a = TorchEngine(target, SuffixDrafter(), EngineConfig(k=4),
                    observers=[TraceRecorder(sink, target.fingerprint)])
    b_drafter = SuffixDrafter()  # replica B's suffix index (each run below is a fresh engine on it)
    params = SamplingParams(max_tokens=24)

    def on_b(tag: str, drafter=b_drafter) -> int:
        b = TorchEngine(target, drafter, EngineConfig(k=4))
        chunks = run(b, [GenerationRequest(request_id=f"b-{tag}", prompt_ids=_family(0), params=params)])
        return chunks[0][-1].stats.accepted_tokens

    without = on_b("control", SuffixDrafter())  # a replica that follows nothing: prompt lookup only
    run(a, [GenerationRequest(request_id=f"a{i}", prompt_ids=_family(i), params=params) for i in range(3)])
    sink.flush(10.0)
    follower = TraceFollower(
        SimpleNamespace(drafter=b_drafter), lambda: KafkaTraceSource(bootstrap_servers=kafka_broker.url, topic=kafka_topic,
                                    group_id="replica-b", session_timeout_ms=2000,
                                    heartbeat_interval_ms=500, auto_offset_reset="earliest"),
        "b").start()
    try:
        deadline = time.monotonic() + 60
        while follower.indexed < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert follower.indexed >= 3
        after = on_b("after")  # B never served the family: what it knows came from A's traces
    finally:
        follower.stop()
        sink.close()
    assert after > without, (without, after)


def test_suffix_part_finds_the_index_holder():
    d = SuffixDrafter()
    assert suffix_part(d) is d
    assert suffix_part(None) is None

    class Hybrid:
        suffix = d

    assert suffix_part(Hybrid()) is d
    assert suffix_part(object()) is None


def test_a_replica_follows_the_topic_only_where_a_suffix_index_can_use_it():
    """SGLang or a learned drafter alone has no suffix index now or after any swap: such a replica
    would read the whole topic to skip every record, so it starts no follower."""
    from serving.api.app import create_app
    from serving.config import ServingSettings

    target = tiny_target(vocab_size=48, hidden_size=64, num_layers=2)
    settings = ServingSettings(trace_sink="kafka", follow_traces=True, kafka_bootstrap_servers="127.0.0.1:9")
    with_index = create_app(TorchEngine(target, SuffixDrafter(), EngineConfig(k=4)), settings)
    assert isinstance(with_index.state.trace_follower, TraceFollower)
    without = create_app(TorchEngine(target, None, EngineConfig(k=4)), settings)  # no index to feed
    assert without.state.trace_follower is None


def test_traces_of_another_target_are_not_indexed():
    """A topic shared with a deployment of another model: its token ids mean other text here, so
    they never reach this replica's suffix index (counted as foreign)."""
    from trace_samples import TEST_TARGET, make_trace

    class Topic:  # the broker's side is test_family_served_on_replica_a_raises_replica_b_acceptance's
        def __init__(self, records):
            self.batches, self.committed = [records], 0

        def poll(self, max_records, timeout_s):
            if self.batches:
                return self.batches.pop()
            time.sleep(0.01)
            return []

        def commit(self):
            self.committed += 1

        def close(self):
            pass

    drafter = SuffixDrafter()
    other = TEST_TARGET.model_copy(update={"tokenizer_hash": "f" * 16})
    topic = Topic([make_trace(request_id="ours", seed=1), make_trace(request_id="theirs", seed=2, target=other)])
    engine = SimpleNamespace(drafter=drafter, fingerprint=TEST_TARGET)
    follower = TraceFollower(engine, lambda: topic, "r").start()
    try:
        deadline = time.monotonic() + 30
        while follower.indexed + follower.foreign < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        follower.stop()
    assert (follower.indexed, follower.foreign, topic.committed) == (1, 1, 1)
    assert drafter.proposer.index("default").num_sequences == 1

