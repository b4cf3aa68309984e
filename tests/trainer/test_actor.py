import pytest

from trainer import checkpoint
from trainer.config import TrainerSettings


def _student():
    from trainer_tracegen import tiny_lm

    from trainer.students import StandaloneStudent

    return StandaloneStudent(tiny_lm(seed=0))


def _source():
    from trainer_tracegen import make_trace

    from trainer.sources import ListTraceSource

    return ListTraceSource([make_trace("a", seed=i) for i in range(60)])


def test_the_source_setting_is_what_the_trainer_reads_or_it_refuses_to_start(tmp_path):
    """SPECLOOP_TRAINER_SOURCE: inprocess needs the caller's source (`specloop train` has none), kafka
    refuses one handed in; refused before Ray starts, and the lineage records the source used."""
    from trainer_tracegen import FP

    from trainer.actor import build_loop, start_actor

    inprocess = TrainerSettings(source="inprocess", tracking_uri="", checkpoint_dir=str(tmp_path))
    with pytest.raises(ValueError, match="SPECLOOP_TRAINER_SOURCE=inprocess needs a trace source"):
        start_actor(inprocess, _student, FP)  # what `specloop train` calls: no source factory
    with pytest.raises(ValueError, match="SPECLOOP_TRAINER_SOURCE=inprocess needs a trace source"):
        build_loop(inprocess, _student(), FP)
    with pytest.raises(ValueError, match="handed in, but SPECLOOP_TRAINER_SOURCE=kafka"):
        build_loop(TrainerSettings(source="kafka", tracking_uri=""), _student(), FP, _source())
    loop = build_loop(inprocess, _student(), FP, _source())
    assert loop.lineage.static["source"] == "inprocess"


@pytest.mark.integration
def test_ray_actor_trains_and_promotes(tmp_path, monkeypatch):
    ray = pytest.importorskip("ray")
    from trainer_tracegen import FP

    from trainer.actor import start_actor

    monkeypatch.setenv("PYTHONPATH", __file__.rsplit("/", 1)[0])
    s = TrainerSettings(source="inprocess", tracking_uri=f"sqlite:///{tmp_path}/m.db",
                        checkpoint_dir=str(tmp_path / "ckpt"), min_train_traces=8, steps_per_round=20,
                        rounds_per_gate=1, poll_records=60, k=3, lr=3e-3,
                        hybrid=False)  # learned alone: see trainer_tracegen.NOT_SUFFIX_TEXT
    try:
        actor = start_actor(s, _student, FP, _source, registry=None)
        stats = ray.get(actor.run.remote(max_rounds=2), timeout=300)
        assert stats["train_steps"] > 0 and stats["promotions"] >= 1, stats
        root = checkpoint.identity_root(tmp_path / "ckpt", checkpoint.identity("default", "standalone", FP))
        assert (checkpoint.latest(root) / "meta.json").exists()
    finally:
        ray.shutdown()


@pytest.mark.integration
def test_remote_trainer_reports_while_running_and_stops_an_endless_run(tmp_path, monkeypatch):
    """stats() and stop() are answered while run() trains (the actor has two threads), so an
    operator's Ctrl-C or the demo's shutdown ends a loop started with no round limit."""
    pytest.importorskip("ray")
    import functools
    import time

    from trainer_tracegen import FP

    from trainer.actor import RemoteTrainer, _loop_from_settings

    monkeypatch.setenv("PYTHONPATH", __file__.rsplit("/", 1)[0])
    s = TrainerSettings(source="inprocess", tracking_uri=f"sqlite:///{tmp_path}/m.db", checkpoint_dir=str(tmp_path / "c"),
                        min_train_traces=8, steps_per_round=5, rounds_per_gate=1, poll_records=4, k=3,
                        hybrid=False)
    factory = functools.partial(_loop_from_settings, s, _student, FP, _source, {"registry": None})
    trainer = RemoteTrainer(factory, refresh_s=0.0).start()
    try:
        deadline = time.monotonic() + 120
        while trainer.stats.train_steps == 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert trainer.stats.train_steps > 0  # read from the actor while run() is still going
        seen = trainer.stats.train_steps
    finally:
        final = trainer.stop(timeout_s=60)
    assert trainer.actor is None
    assert final.rounds >= 1 and final.train_steps >= seen  # the run's own last figures


@pytest.mark.integration
def test_killed_actor_is_restarted_by_ray_and_resumes_from_its_checkpoint(tmp_path, monkeypatch):
    """A dead trainer worker comes back (``max_restarts``): the loop factory runs again and the loop
    resumes from its latest checkpoint (its step count and replay), not from scratch."""
    ray = pytest.importorskip("ray")
    import os

    from trainer_tracegen import FP

    from trainer.actor import start_actor

    here = __file__.rsplit("/", 1)[0]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([here, os.getcwd()]))
    s = TrainerSettings(source="inprocess", tracking_uri="", checkpoint_dir=str(tmp_path / "ckpt"),
                        min_train_traces=8, steps_per_round=5, rounds_per_gate=100, poll_records=20, k=3,
                        hybrid=False)
    try:
        actor = start_actor(s, _student, FP, _source, registry=None)
        before = ray.get(actor.run.remote(max_rounds=2), timeout=300)
        assert before["train_steps"] == 10
        ray.kill(actor, no_restart=False)  # the worker dies; Ray starts a new one
        after = ray.get(actor.stats.remote(), timeout=300)
        assert after["train_steps"] == before["train_steps"]  # restored, not a fresh loop
        assert after["trace_tokens_seen"] == before["trace_tokens_seen"]
    finally:
        ray.shutdown()
