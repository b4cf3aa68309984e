"""Well-framed traces whose content would poison or crash training, on a real broker: the trainer's
consumer dead-letters them with the reason, trains on the rest without a failed round, and commits
past all of them."""

from __future__ import annotations

import math
import time

import pytest
from trace_samples import POISONED, poisoned_trace
from trainer_tracegen import FP, make_trace, tiny_lm

from feedback.bus.codec import encode
from trainer.config import TrainerSettings


@pytest.mark.integration
def test_poisoned_traces_are_dead_lettered_and_never_trained_on(kafka_broker, kafka_topic, tmp_path, monkeypatch):
    from kafka import KafkaProducer

    from trainer.actor import build_loop
    from trainer.students import StandaloneStudent

    monkeypatch.setenv("SPECLOOP_KAFKA_SESSION_TIMEOUT_MS", "2000")
    monkeypatch.setenv("SPECLOOP_KAFKA_HEARTBEAT_INTERVAL_MS", "500")
    good = [make_trace("a", seed=i) for i in range(30)]
    bad = [poisoned_trace(name, target=FP, seed=500 + i) for i, name in enumerate(POISONED)]
    values = [encode(r) for r in good]
    for i, r in enumerate(bad):  # spread among the good ones
        values.insert(3 * i + 1, encode(r))
    producer = KafkaProducer(bootstrap_servers=kafka_broker.url, acks="all")
    for value in values:
        producer.send(kafka_topic, key=b"default", value=value)
    producer.flush()
    producer.close()

    s = TrainerSettings(source="kafka", bootstrap_servers=kafka_broker.url, topic=kafka_topic,
                        group_id="trainer-poisoned", tracking_uri="", checkpoint_dir=str(tmp_path / "ckpt"),
                        min_train_traces=8, poll_records=15, poll_timeout_s=1.0, steps_per_round=4,
                        rounds_per_gate=100, k=3, lr=3e-3)
    loop = build_loop(s, StandaloneStudent(tiny_lm(seed=0)), FP)
    try:
        seen = lambda: {r.request_id for r in loop.replay.train_records + loop.replay.heldout}
        committed = lambda: sum(o or 0 for o in loop.source.committed().values())
        deadline = time.monotonic() + 60
        while (len(seen()) < len(good) or committed() < len(values)) and time.monotonic() < deadline:
            loop.run_round()  # a round that raised would fail the test here
            if len(seen()) == len(good):
                loop.source.commit()  # what the next round with new traffic would commit
        assert seen() == {r.request_id for r in good}
        assert loop.source.dead_lettered == len(POISONED)
        assert loop.stats.train_steps > 0 and all(math.isfinite(x) for x in loop.stats.losses)
        assert committed() == len(values)
    finally:
        loop.source.close()
