"""The trainer on real services: Redis heartbeats pause it and promotions are announced there; a
trainer consuming from a real Kafka broker is killed mid-training and resumes from its checkpoint
and the group's committed offsets with nothing lost."""

from __future__ import annotations

import time

import pytest
import torch
from trainer_tracegen import FP, make_trace, tiny_lm

from trainer.config import TrainerSettings


def _student():
    from trainer.students import StandaloneStudent

    return StandaloneStudent(tiny_lm(seed=0))


@pytest.mark.integration
def test_redis_heartbeats_pause_training_and_promotions_are_announced(redis_server, redis_namespace, tmp_path,
                                                                        monkeypatch):
    from feedback.control.plane import ControlPlane, LoadHeartbeat, SwapAnnouncement
    from trainer.actor import build_loop
    from trainer.sources import ListTraceSource

    monkeypatch.setenv("SPECLOOP_REDIS_NAMESPACE", redis_namespace)  # read by build_loop's ControlPlane too
    control = ControlPlane(url=redis_server.url)
    s = TrainerSettings(source="inprocess", redis_url=redis_server.url, tracking_uri="", checkpoint_dir=str(tmp_path),
                        min_train_traces=8, poll_records=60, steps_per_round=20, rounds_per_gate=1, k=3, lr=3e-3,
                        max_queue_depth=4, hybrid=False)  # learned alone: see trainer_tracegen.NOT_SUFFIX_TEXT
    loop = build_loop(s, _student(), FP, ListTraceSource([make_trace("a", seed=i) for i in range(60)]))
    loop.saturated.cache_s = 0.0  # re-read the heartbeats on every call
    sub = control.subscribe()
    try:
        assert sub.wait_subscribed()
        control.heartbeat(LoadHeartbeat(replica_id="r0", queue_depth=9), ttl_s=30)
        loop.run_round()
        assert loop.stats.paused_rounds == 1 and loop.stats.train_steps == 0
        control.heartbeat(LoadHeartbeat(replica_id="r0", queue_depth=2), ttl_s=30)
        loop.run_round()
        assert loop.stats.train_steps > 0 and loop.stats.promotions == 1, loop.stats.last_decision
        msg = sub.get(timeout=5)
        assert isinstance(msg, SwapAnnouncement) and msg.version == loop.champion_version
        assert msg.tenant == "default" and msg.drafter_kind == "standalone" and msg.target_key == FP.key()
        assert control.get_drafter_version("default") == loop.champion_version
    finally:
        sub.close()
        control.close()


def _ids(loop) -> set[str]:
    return {r.request_id for r in loop.replay.train_records} | {r.request_id for r in loop.replay.heldout}


@pytest.mark.integration
def test_trainer_killed_mid_training_resumes_from_checkpoint_and_committed_offsets(kafka_broker, kafka_topic, tmp_path,
                                                                                    monkeypatch):
    from feedback.bus.kafka_sink import KafkaTraceSink
    from trainer.actor import build_loop

    # short group timings (read by the KafkaTraceSource that build_loop makes): a restarted member
    # joins within seconds
    monkeypatch.setenv("SPECLOOP_KAFKA_SESSION_TIMEOUT_MS", "2000")
    monkeypatch.setenv("SPECLOOP_KAFKA_HEARTBEAT_INTERVAL_MS", "500")
    records = [make_trace("a", seed=i) for i in range(60)]
    sink = KafkaTraceSink(bootstrap_servers=kafka_broker.url, topic=kafka_topic, linger_ms=5)
    for r in records:
        sink.emit(r)
    assert sink.flush(10) and sink.sent == 60
    sink.close()

    s = TrainerSettings(source="kafka", bootstrap_servers=kafka_broker.url, topic=kafka_topic,
                        group_id="trainer-resume", tracking_uri="", checkpoint_dir=str(tmp_path / "ckpt"),
                        min_train_traces=8, poll_records=15, poll_timeout_s=1.0, steps_per_round=3,
                        rounds_per_gate=100, k=3, lr=3e-3)
    first = build_loop(s, _student(), FP)  # the KafkaTraceSource build_loop makes from settings
    deadline = time.monotonic() + 60
    while first.stats.rounds < 2 and time.monotonic() < deadline:
        first.run_round()
    assert first.stats.rounds == 2
    trained, step = _ids(first), first.distiller.global_step
    params = [p.detach().clone() for p in first.student.model.parameters()]
    in_flight = first.source.poll(15, 2.0)  # polled, then killed before training on them: never committed
    assert in_flight and not ({r.request_id for r in in_flight} & trained)
    first.source.close()

    second = build_loop(s, _student(), FP)
    assert second.distiller.global_step == step and _ids(second) == trained
    for a, b in zip(params, second.student.model.parameters()):
        assert torch.equal(a, b)
    deadline = time.monotonic() + 60
    while len(_ids(second)) < 60 and time.monotonic() < deadline:
        second.run_round()
    try:
        assert _ids(second) == {r.request_id for r in records}, (len(_ids(second)), second.stats.records_polled, second.stats.rounds, dict(second.replay.rejected), second.source.committed())
        assert second.replay.rejected["duplicate"] == 0  # committed records were not redelivered
        assert second.stats.records_polled == 60 - first.stats.records_polled
        assert sum(o or 0 for o in second.source.committed().values()) == 60
    finally:
        second.source.close()
