"""Redis control plane on a real redis-server, including Redis going away and coming back."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from feedback.control.plane import (
    AcceptanceCounts,
    ControlPlane,
    LoadHeartbeat,
    RollbackAnnouncement,
    SwapAnnouncement,
)

pytestmark = pytest.mark.integration


@pytest.fixture
def control(redis_server, redis_namespace):
    cp = ControlPlane(url=redis_server.url, namespace=redis_namespace)
    yield cp
    cp.close()


def test_drafter_version_per_tenant(control):
    assert control.get_drafter_version("acme") is None
    assert control.set_drafter_version("acme", "eagle-3")
    assert control.set_drafter_version("globex", "suffix-1")
    assert control.get_drafter_version("acme") == "eagle-3"
    assert control.get_drafter_version("globex") == "suffix-1"


def test_swap_and_rollback_announcements_reach_subscribers_typed(control):
    sub = control.subscribe()
    received_by_callback = []
    got_callback = threading.Event()
    cb_sub = control.subscribe(lambda m: (received_by_callback.append(m), got_callback.set()))
    try:
        assert sub.wait_subscribed() and cb_sub.wait_subscribed()
        swap = SwapAnnouncement(tenant="acme", version="v2", previous_version="v1",
                                drafter_kind="eagle", target_key="SmolLM2-abc")
        assert control.announce_swap(swap)
        assert control.get_drafter_version("acme") == "v2"  # set with the announcement
        got = sub.get(timeout=5)
        assert isinstance(got, SwapAnnouncement) and got == swap

        rollback = RollbackAnnouncement(tenant="acme", from_version="v2", to_version="v1",
                                        reason="acceptance below floor", live_acceptance=0.12,
                                        floor=0.3, replica_id="r0")
        assert control.announce_rollback(rollback)
        assert control.get_drafter_version("acme") == "v1"
        got = sub.get(timeout=5)
        assert isinstance(got, RollbackAnnouncement) and got == rollback
        assert got_callback.wait(5)
        deadline = time.monotonic() + 5
        while len(received_by_callback) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert received_by_callback == [swap, rollback]

        control._client.publish(control.channel, "{not json")  # malformed: ignored, not fatal
        assert control.announce_swap(SwapAnnouncement(tenant="acme", version="v3"))
        assert sub.get(timeout=5).version == "v3"
    finally:
        sub.close()
        cb_sub.close()


def test_load_heartbeats_expire(control):
    assert control.heartbeat(LoadHeartbeat(replica_id="r0", queue_depth=3, running_requests=2,
                                           tokens_per_s=41.5))
    assert control.heartbeat(LoadHeartbeat(replica_id="r1", queue_depth=0), ttl_s=0.3)
    loads = {b.replica_id: b for b in control.loads()}
    assert set(loads) == {"r0", "r1"}
    assert loads["r0"].queue_depth == 3 and loads["r0"].tokens_per_s == 41.5
    time.sleep(0.5)
    assert [b.replica_id for b in control.loads()] == ["r0"]


def test_acceptance_counters_accumulate_per_version(control):
    assert control.acceptance("acme", "v9") == AcceptanceCounts()
    assert control.record_acceptance("acme", "v9", drafted=40, accepted=10, rows=10)
    assert control.record_acceptance("acme", "v9", drafted=20, accepted=14, rows=5)
    assert control.record_acceptance("acme", "v8", drafted=5, accepted=5, rows=1)
    counts = control.acceptance("acme", "v9")
    assert (counts.drafted, counts.accepted, counts.rows) == (60, 24, 15)
    assert counts.rate == pytest.approx(0.4)
    assert counts.tokens_per_row == pytest.approx(39 / 15)
    assert control.acceptance("acme", "v8").accepted == 5


def test_tenants_sharing_a_namespace_keep_their_own_counts_of_the_same_version(control):
    """Every tenant has a "day0" and a "1": the counts of one are not added into the other's."""
    assert control.record_acceptance("acme", "day0", drafted=8, accepted=2, rows=4)
    assert control.record_acceptance("globex", "day0", drafted=10, accepted=9, rows=2)
    assert control.record_acceptance("globex", "1", drafted=3, accepted=3, rows=1)
    assert control.acceptance("acme", "day0") == AcceptanceCounts(drafted=8, accepted=2, rows=4)
    assert control.acceptance("globex", "day0") == AcceptanceCounts(drafted=10, accepted=9, rows=2)
    assert control.acceptance("acme", "1") == AcceptanceCounts()


@pytest.mark.usefixtures("requires_redis")
def test_redis_down_returns_defaults_without_raising_then_recovers(private_stack, caplog):
    redis = private_stack.start_redis()
    cp = ControlPlane(url=redis.url, namespace="down", retry_after_s=0.3, socket_timeout_s=0.3)
    sub = cp.subscribe()
    try:
        assert cp.set_drafter_version("acme", "v1") and sub.wait_subscribed()
        private_stack.stop("redis")

        caplog.set_level(logging.WARNING, logger="feedback.control.plane")
        t0 = time.monotonic()
        for _ in range(3):
            assert cp.get_drafter_version("acme") is None
            assert cp.set_drafter_version("acme", "v2") is False
            assert cp.announce_swap(SwapAnnouncement(tenant="acme", version="v2")) is False
            assert cp.heartbeat(LoadHeartbeat(replica_id="r0")) is False
            assert cp.loads() == []
            assert cp.record_acceptance("acme", "v1", 4, 2, 1) is False
            assert cp.acceptance("acme", "v1") == AcceptanceCounts()
            assert cp.ping() is False
        assert time.monotonic() - t0 < 2.0  # no per-call waiting on a dead socket
        time.sleep(1.0)  # several subscriber reconnect attempts
        messages = [r.getMessage() for r in caplog.records if r.name == "feedback.control.plane"]
        assert sum("control plane unavailable" in m for m in messages) == 1  # logged once
        assert sum("subscription lost" in m for m in messages) == 1

        private_stack.start_redis(port=redis.port)  # an empty Redis comes back
        deadline = time.monotonic() + 5
        while not cp.set_drafter_version("acme", "v3") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert cp.get_drafter_version("acme") == "v3"
        assert sub.wait_subscribed(timeout=5)  # the subscriber thread survived and resubscribed
        assert cp.announce_swap(SwapAnnouncement(tenant="acme", version="v4"))
        assert sub.get(timeout=5).version == "v4"
    finally:
        sub.close()
        cp.close()
