"""`specloop train` with its broker down at start: the actor's constructor (which builds the Kafka
source through ``_loop_from_settings``) returns at once, and the loop runs rounds that poll nothing,
answering ``stats()`` and ``stop()``, instead of the actor dying (Ray does not restart an actor
whose constructor raised)."""

from __future__ import annotations

import functools
import threading
import time

from trainer_tracegen import FP, tiny_lm

from infra.stack import free_port
from trainer.config import TrainerSettings


def _student():
    from trainer.students import StandaloneStudent

    return StandaloneStudent(tiny_lm(seed=0))


def test_the_trainer_actor_starts_without_a_broker_and_answers_stats_and_stop(tmp_path, monkeypatch):
    from trainer.actor import TrainerActor, _loop_from_settings

    monkeypatch.setenv("SPECLOOP_KAFKA_BOOTSTRAP_TIMEOUT_MS", "300")
    s = TrainerSettings(source="kafka", bootstrap_servers=f"127.0.0.1:{free_port()}", topic="specloop.traces.down",
                        group_id="trainer-down", tracking_uri="", redis_url=None, checkpoint_dir=str(tmp_path),
                        poll_timeout_s=0.2)
    t = time.monotonic()
    actor = TrainerActor(functools.partial(_loop_from_settings, s, _student, FP, None, {}))
    assert time.monotonic() - t < 10  # was: ~30 s, then KafkaTimeoutError out of the constructor
    result = {}
    runner = threading.Thread(target=lambda: result.update(actor.run()), daemon=True)
    runner.start()
    try:
        time.sleep(1.5)
        stats = actor.stats()
        assert stats["records_polled"] == 0 and stats["round_errors"] == 0, stats
    finally:
        t = time.monotonic()
        actor.stop()
        runner.join(10)
        actor.loop.source.close()
    assert not runner.is_alive() and time.monotonic() - t < 5
    assert result["records_polled"] == 0
