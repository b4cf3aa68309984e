"""The trainer follows serving's rollbacks (issue 14): its champion reverts to the version serving
went back to, and the rolled-back weights are not promoted again unchanged."""

from __future__ import annotations

import pytest
from trainer_tracegen import FP, make_trace, tiny_lm

from feedback.control.plane import ControlPlane, ControlSettings, RollbackAnnouncement
from trainer.digest import weights_digest
from trainer.distill import DistillConfig
from trainer.gate import GateConfig
from trainer.loop import LoopConfig, TrainerLoop
from trainer.sources import ListTraceSource
from trainer.students import StandaloneStudent


def _promoting_loop(**kw):
    src = ListTraceSource([make_trace("a", seed=i, tenant="acme") for i in range(80)])
    return TrainerLoop(src, StandaloneStudent(tiny_lm(seed=0)), FP,
                       loop=LoopConfig(tenant="acme", poll_records=40, min_train_traces=8, steps_per_round=30,
                                       rounds_per_gate=1),
                       distill=DistillConfig(lr=3e-3, eval_every=10), gate=GateConfig(k=3, hybrid=False), **kw)


def test_rollback_reverts_champion_and_refuses_the_same_weights():
    loop = _promoting_loop()
    loop.run_round()
    assert loop.stats.promotions == 1, loop.stats.last_decision
    first = loop.champion_version
    loop.champion = None  # pretend a weaker champion so the same student would pass the gate again
    loop.champion_version = None
    loop._champions[first] = loop.student  # what serving runs as `first`
    loop.on_rollback(RollbackAnnouncement(tenant="acme", from_version=first, to_version="day0",
                                          reason="live acceptance fell"))
    loop.on_rollback(RollbackAnnouncement(tenant="other", from_version="9", to_version="8"))  # not ours
    assert loop.apply_rollbacks() == 1
    assert loop.champion is None and loop.champion_version is None  # day0 is not a version it holds
    assert loop._refused == {first: weights_digest(loop.student)}
    d = loop.gate()  # the student is exactly what was rolled back
    assert not d.promote and "rolled back" in d.reason
    assert loop.stats.promotions == 1


def test_rollback_to_a_version_the_trainer_holds_makes_it_champion_again():
    loop = _promoting_loop()
    loop.run_round()
    v1 = loop.champion_version
    held = loop.champion
    loop.run_round()  # new traces: maybe a second promotion; force one to test the revert
    loop._champions["2"] = loop.student
    loop.champion, loop.champion_version = loop.student, "2"
    loop.on_rollback(RollbackAnnouncement(tenant="acme", from_version="2", to_version=v1))
    loop.apply_rollbacks()
    assert loop.champion is held and loop.champion_version == v1


@pytest.mark.integration
def test_rollback_announced_on_redis_reaches_the_trainer(redis_server, redis_namespace):
    import time

    control = ControlPlane(ControlSettings(url=redis_server.url, namespace=redis_namespace))
    loop = _promoting_loop(rollbacks_from=ControlPlane(ControlSettings(url=redis_server.url,
                                                                      namespace=redis_namespace)))
    assert loop._subscription.wait_subscribed(5.0)
    control.announce_rollback(RollbackAnnouncement(tenant="acme", from_version="3", to_version="2"))
    deadline = time.monotonic() + 5
    while loop.announcements.rollbacks.empty() and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        assert loop.apply_rollbacks() == 1
    finally:
        loop._subscription.close()
