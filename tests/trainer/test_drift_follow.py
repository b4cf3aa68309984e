"""The trainer reacts to serving's acceptance drift (issue 15): it samples the drifted domain's
traces more for a while, and gates at the end of the next round instead of waiting for the regular
gate."""

from __future__ import annotations

import time

import numpy as np
import pytest
from trainer_tracegen import FP, make_trace, tiny_lm

from feedback.control.plane import ControlPlane, ControlSettings, DriftAnnouncement
from feedback.ops.drift import DriftEvent
from trainer.distill import DistillConfig
from trainer.gate import GateConfig
from trainer.loop import LoopConfig, TrainerLoop
from trainer.sources import ListTraceSource
from trainer.students import StandaloneStudent


def _loop(**kw):
    traces = [make_trace(d, seed=i, tenant="acme") for i in range(30) for d in ("a", "b")]
    return TrainerLoop(ListTraceSource(traces), StandaloneStudent(tiny_lm(seed=0)), FP,
                       loop=LoopConfig(tenant="acme", poll_records=20, min_train_traces=8, steps_per_round=4,
                                       rounds_per_gate=1000, drift_boost=4.0, drift_rounds=2),
                       distill=DistillConfig(lr=3e-3, eval_every=100), gate=GateConfig(k=3, hybrid=False), **kw)


def _share(loop, domain: str) -> float:
    w = loop.replay.weights()
    doms = np.array([(r.domain or "default") == domain for r in loop.replay.train_records])
    return float(w[doms].sum() / w.sum())


def test_a_drift_focuses_training_on_its_domain_and_gates_early():
    loop = _loop()
    loop.run_round()
    assert loop.stats.rounds == 1 and loop.stats.last_decision == ""  # no gate yet (every 1000 rounds)
    before = _share(loop, "b")
    loop.on_announcement(DriftAnnouncement(tenant="acme", domain="b", before=0.6, now=0.2, replica_id="a"))
    loop.on_announcement(DriftAnnouncement(tenant="other", domain="a", before=0.6, now=0.2))  # not ours
    loop.run_round()
    assert loop.stats.drifts == 1
    assert loop.replay.focus == {"b": 4.0}
    assert _share(loop, "b") > before + 0.2  # code traces are drawn ~4x as often
    assert loop.stats.last_decision != ""  # the round after the drift ended with a gate
    for _ in range(3):
        loop.run_round()
    assert loop.replay.focus == {}  # the focus lasts drift_rounds trained rounds


@pytest.mark.integration
def test_drift_published_by_serving_reaches_the_trainer_over_redis(redis_server, redis_namespace):
    from serving.ops_observer import DriftPublisher

    settings = ControlSettings(url=redis_server.url, namespace=redis_namespace)
    loop = _loop(rollbacks_from=ControlPlane(settings))
    try:
        assert loop._subscription.wait_subscribed(5.0)
        publish = DriftPublisher(ControlPlane(settings), "acme", "replica-a")
        publish(DriftEvent("b", before=0.7, now=0.1))
        deadline = time.monotonic() + 5
        while loop.announcements.drifts.empty() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert loop.apply_drifts() == 1 and loop.replay.focus == {"b": 4.0}
        assert publish.published == 1
    finally:
        loop._subscription.close()



def test_pause_and_resume_are_logged_once_each(tmp_path):
    """Operators see when training paused for serving's load and when it resumed (issue 15)."""
    from feedback.ops.ops_log import OpsRun

    busy = {"now": False}
    ops = OpsRun(f"sqlite:///{tmp_path}/m.db", "specloop/x", "trainer-acme-g", flush_s=3600)
    traces = [make_trace("a", seed=i, tenant="acme") for i in range(60)]
    loop = TrainerLoop(ListTraceSource(traces), StandaloneStudent(tiny_lm(seed=0)), FP,
                       loop=LoopConfig(tenant="acme", poll_records=10, min_train_traces=4, steps_per_round=2,
                                       rounds_per_gate=1000),
                       distill=DistillConfig(lr=3e-3, eval_every=100), gate=GateConfig(k=3, hybrid=False),
                       saturated=lambda: busy["now"], ops=ops)
    loop.run_round()
    busy["now"] = True
    loop.run_round()
    loop.run_round()
    busy["now"] = False
    loop.run_round()
    assert loop.stats.paused_rounds == 2
    ops.flush()
    got = ops.client.get_run(ops.run_id).data
    assert got.metrics["event.paused"] == 1 and got.metrics["event.resumed"] == 1
    ops.close()
