"""The champion alias after a rollback, and replicas that follow one: a rollback to the day-0
drafter (which the registry does not hold) takes the alias off, so that a replica started later
does not swap the rolled-back version in again; an alias move that failed is tried again at the
next flush until it is done or a promotion moved the alias since; another replica goes back to
the version announced, its own day-0 drafter included, and a replica that missed the announcement
goes back to day 0 when its poll finds the alias taken off.

Real MLflow (sqlite in tmp_path) and Redis (``redis_server``). Target: a tiny random Llama; the
registered versions are standalone copies of it.
"""

from __future__ import annotations

import time

import pytest
from swap_replicas import register_copy, replica

from feedback.control.plane import (
    ControlPlane,
    ControlSettings,
    RollbackAnnouncement,
    SwapAnnouncement,
)
from feedback.registry.drafter_registry import DrafterRegistry
from serving.target import tiny_target

V, LAYERS, TENANT = 128, 2, "aliastest"


@pytest.fixture(scope="module")
def target():
    return tiny_target(vocab_size=V, hidden_size=64, num_layers=LAYERS, seed=0)


@pytest.fixture
def registry(tmp_path):
    return DrafterRegistry(f"sqlite:///{tmp_path}/mlflow.db")


def _register(registry, target, path) -> str:
    """A new version, made champion (as the trainer's promotion does)."""
    return register_copy(registry, target, path, TENANT)


def _replica(target, registry, name, control=None):
    return replica(target, registry, name, TENANT, control=control, log_interval_s=0.5)


def _failing(registry, method: str, times: int) -> list:
    """``registry.method`` fails its first ``times`` calls (MLflow unreachable); returns the calls."""
    real, calls = getattr(registry, method), []

    def flaky(*args):
        calls.append(args)
        if len(calls) <= times:
            raise ConnectionError("MLflow unreachable")
        return real(*args)

    setattr(registry, method, flaky)
    return calls


def _until(cond, timeout: float = 30.0) -> bool:
    """Waits for a background effect (no timing is asserted; the deadline only bounds a hang)."""
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    return cond()


def test_a_rollback_to_day0_takes_the_alias_off_and_a_later_replica_stays_on_day0(
        target, tmp_path, registry):
    v1 = _register(registry, target, tmp_path / "a")
    _, a = _replica(target, registry, "replica-a")
    try:
        a.swap_to(v1, reason="announcement")
        assert a.rollback(reason="operator") == {"from_version": v1, "to_version": "day0"}
        assert a.records.flush()
    finally:
        a.stop()
    assert registry.champion(TENANT) is None  # the version stays registered, not champion
    engine, c = _replica(target, registry, "replica-c")  # started after the rollback
    day0 = engine.drafter
    c.poll_once()
    assert c.version == "day0" and engine.drafter is day0 and c.swaps == 0
    c.stop()


def test_a_failed_alias_move_is_tried_again_at_the_next_flush(target, tmp_path, registry):
    v1 = _register(registry, target, tmp_path / "a")
    v2 = _register(registry, target, tmp_path / "b")
    _, a = _replica(target, registry, "replica-a")
    a.swap_to(v1)
    a.swap_to(v2)
    calls = _failing(registry, "set_champion", times=1)
    try:
        assert a.rollback(reason="operator")["to_version"] == v1
        assert a.records.flush()
        assert registry.champion(TENANT).version == v2 and len(calls) == 1  # the move failed
        a._flush_live()
        assert a.records.flush()
        assert registry.champion(TENANT).version == v1 and calls == [(TENANT, v1)] * 2
        a._flush_live()  # done: not tried again
        assert a.records.flush() and len(calls) == 2
    finally:
        a.stop()


def test_a_failed_move_superseded_by_a_promotion_is_dropped(target, tmp_path, registry):
    v1 = _register(registry, target, tmp_path / "a")
    _, a = _replica(target, registry, "replica-a")
    a.swap_to(v1)
    calls = _failing(registry, "clear_champion", times=99)
    try:
        a.rollback(reason="operator")
        assert a.records.flush() and len(calls) == 1
        assert registry.champion(TENANT).version == v1
        v2 = _register(registry, target, tmp_path / "b")  # the trainer promoted a successor since
        for _ in range(2):
            a._flush_live()
            assert a.records.flush()
        assert registry.champion(TENANT).version == v2 and len(calls) == 1  # left where it is
    finally:
        a.stop()


def test_a_replica_whose_previous_drafter_is_not_day0_follows_a_rollback_to_day0(
        target, tmp_path, registry, redis_server, redis_namespace):
    v1 = _register(registry, target, tmp_path / "a")
    v2 = _register(registry, target, tmp_path / "b")
    settings = ControlSettings(url=redis_server.url, namespace=redis_namespace)
    _, a = _replica(target, registry, "replica-a", control=ControlPlane(settings))
    engine, b = _replica(target, registry, "replica-b", control=ControlPlane(settings))
    day0 = engine.drafter
    a.swap_to(v2)  # a started after v1's time: day0 -> v2
    b.swap_to(v1)
    b.swap_to(v2)  # b: day0 -> v1 -> v2, its previous drafter is v1
    b.start()
    try:
        assert b.wait_subscribed()
        a.rollback(reason="operator")
        assert _until(lambda: b.version == "day0")
    finally:
        b.stop()
        a.stop()
    assert engine.drafter is day0  # the drafter it started with, not a download
    status = b.status()
    assert status["previous_version"] is None and status["watching"] is None
    assert b.events[-1]["event"] == "swap" and b.events[-1]["previous_version"] == v2
    assert "rollback announced by replica-a" in b.events[-1]["reason"]
    assert b.swap_to(v2, force=False)["changed"] is False  # not taken again unasked


def test_a_replica_following_a_rollback_to_a_registry_version_does_not_watch_it(
        target, tmp_path, registry):
    """Its previous drafter is not the one announced: it swaps to that one, neither watched
    against the version rolled back nor able to roll back to it."""
    v1, v2, v3 = (_register(registry, target, tmp_path / n) for n in "abc")
    _, b = _replica(target, registry, "replica-b")
    b.swap_to(v1)
    b.swap_to(v3)
    b._on_announcement(RollbackAnnouncement(tenant=TENANT, from_version=v3, to_version=v2,
                                            replica_id="replica-a", reason="below floor"))
    status = b.status()
    assert status["version"] == v2 and status["previous_version"] is None
    assert status["watching"] is None
    b.stop()


def test_a_replica_that_missed_the_announcement_goes_back_to_day0_when_the_alias_is_off(
        target, tmp_path, registry):
    v1 = _register(registry, target, tmp_path / "a")
    engine, d = _replica(target, registry, "replica-d")
    day0 = engine.drafter
    d._on_announcement(SwapAnnouncement(tenant=TENANT, version=v1))
    d.poll_once()
    assert d.version == v1 and d.swaps == 1  # the alias names what it runs: nothing to do
    registry.clear_champion(TENANT)  # another replica rolled v1 back to day 0; d missed it
    d.poll_once()
    assert d.version == "day0" and engine.drafter is day0
    d.poll_once()
    assert d.swaps == 2 and d.version == "day0"
    d.stop()


def test_a_replica_serving_another_version_keeps_it_when_the_alias_is_taken_off(
        target, tmp_path, registry):
    v1 = _register(registry, target, tmp_path / "a")
    v2 = _register(registry, target, tmp_path / "b")
    _, d = _replica(target, registry, "replica-d")
    d.poll_once()
    assert d.version == v2  # the champion
    d.swap_to(v1, reason="operator's choice")
    registry.clear_champion(TENANT)
    d.poll_once()
    assert d.version == v1
    d.stop()

