"""DELETE /admin/tenants/{tenant}: the tenant's suffix index is gone at once (its continuations are
no longer drafted), other tenants keep theirs, and the trainer is asked to delete its traces."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
from prometheus_client import CollectorRegistry

from serving.api.app import create_app
from serving.builder import build_engine
from serving.config import ServingSettings
from serving.target import tiny_target

TOKEN = "admin-token-for-tests-7c1"


class _Control:
    def __init__(self):
        self.requested = []

    def request_deletion(self, tenant):
        self.requested.append(tenant)
        return True

    def deletion_requested_at(self, tenant):
        return None


def test_admin_deletes_a_tenants_index_and_asks_the_trainer():
    settings = ServingSettings(served_model_name="tiny", drafter="suffix", admin_token=TOKEN)
    engine = build_engine(settings, target=tiny_target(vocab_size=101), registry=CollectorRegistry())
    control = _Control()
    app = create_app(engine, settings, CollectorRegistry(),
                     swapper=SimpleNamespace(control=control, start=lambda: None, stop=lambda: None))
    drafter = engine.drafter
    drafter.observe("acme", [5, 6, 7, 8, 9, 10])
    drafter.observe("beta", [1, 2, 3, 4])

    async def go(path, token=TOKEN):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.delete(path, headers={"Authorization": f"Bearer {token}"})

    assert asyncio.run(go("/admin/tenants/acme", "wrong")).status_code == 403
    r = asyncio.run(go("/admin/tenants/acme"))
    assert r.status_code == 200
    assert r.json() == {"tenant": "acme", "suffix_index_dropped": True, "trainer_deletion_requested": True}
    assert control.requested == ["acme"]
    assert "acme" not in drafter.proposer.indexes and drafter.index("acme").num_tokens == 0
    assert drafter.index("beta").num_tokens > 0


def _app_with(control):
    settings = ServingSettings(served_model_name="tiny", drafter="suffix", admin_token=TOKEN)
    engine = build_engine(settings, target=tiny_target(vocab_size=101), registry=CollectorRegistry())
    swapper = None if control is None else SimpleNamespace(control=control, start=lambda: None,
                                                           stop=lambda: None)
    return create_app(engine, settings, CollectorRegistry(), swapper=swapper), engine.drafter


def _delete(app, tenant):
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.delete(f"/admin/tenants/{tenant}", headers={"Authorization": f"Bearer {TOKEN}"})

    return asyncio.run(go())


def test_a_deletion_that_does_not_reach_the_trainer_is_a_503_to_retry():
    """Redis down: the control plane cannot take the request (request_deletion is False). A 200
    told the operator the tenant's data was on its way out while the trainer kept it."""
    from feedback.control.plane import ControlPlane
    from infra.stack import free_port

    control = ControlPlane(url=f"redis://127.0.0.1:{free_port()}/0", namespace="nobody-listens")
    app, drafter = _app_with(control)
    drafter.observe("acme", [5, 6, 7, 8, 9, 10])
    try:
        r = _delete(app, "acme")
        assert r.status_code == 503, r.text
        assert int(r.headers["retry-after"]) >= 1
        error = r.json()["error"]
        assert error["type"] == "server_error" and error["code"] == "trainer_unreachable"
        assert "trainer was not reached" in error["message"] and "Retry" in error["message"]
        assert drafter.index("acme").num_tokens == 0  # the local part is done anyway
        again = _delete(app, "acme")  # a retry while Redis is still down: the same answer
        assert again.status_code == 503 and again.headers["retry-after"]
    finally:
        control.close()


def test_a_deletion_the_control_plane_refuses_is_503_and_one_it_takes_is_200():
    class Flaky(_Control):
        up = False

        def request_deletion(self, tenant):
            super().request_deletion(tenant)
            return self.up

    control = Flaky()
    app, drafter = _app_with(control)
    drafter.observe("acme", [5, 6, 7, 8])
    assert _delete(app, "acme").status_code == 503  # the index is gone; the retry still names acme
    control.up = True
    r = _delete(app, "acme")
    assert r.status_code == 200
    assert r.json() == {"tenant": "acme", "suffix_index_dropped": False, "trainer_deletion_requested": True}
    assert control.requested == ["acme", "acme"]


def test_without_a_control_plane_the_deletion_is_local_and_200():
    app, drafter = _app_with(None)
    drafter.observe("acme", [5, 6, 7, 8])
    r = _delete(app, "acme")
    assert r.status_code == 200
    assert r.json() == {"tenant": "acme", "suffix_index_dropped": True, "trainer_deletion_requested": False}


def test_a_tenant_the_server_cannot_name_is_a_404_unless_forced():
    """A typo filed a deletion request no trainer ever completes, and the 200 said it was asked."""
    settings = ServingSettings(served_model_name="tiny", drafter="suffix", admin_token=TOKEN,
                               api_keys={"sk-acme-1": "acme"})
    engine = build_engine(settings, target=tiny_target(vocab_size=101), registry=CollectorRegistry())
    control = _Control()
    app = create_app(engine, settings, CollectorRegistry(),
                     swapper=SimpleNamespace(control=control, start=lambda: None, stop=lambda: None))
    r = _delete(app, "acmee")
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_tenant"
    assert "force=true" in r.json()["error"]["message"] and control.requested == []
    assert _delete(app, "acme").status_code == 200  # an API key's tenant, no index yet
    assert _delete(app, "acmee?force=true").status_code == 200
    assert control.requested == ["acme", "acmee"]


def test_an_operator_sees_when_the_trainer_has_done_the_deletion(redis_server, redis_namespace):
    from feedback.control.plane import ControlPlane, ControlSettings

    control = ControlPlane(ControlSettings(url=redis_server.url, namespace=redis_namespace))
    app, drafter = _app_with(control)
    drafter.observe("acme", [5, 6, 7, 8])

    async def get(tenant):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.get(f"/admin/tenants/{tenant}", headers={"Authorization": f"Bearer {TOKEN}"})

    try:
        before = asyncio.run(get("acme")).json()
        assert before["known"] and before["suffix_index"] and before["deletion_pending"] is False
        assert _delete(app, "acme").status_code == 200
        pending = asyncio.run(get("acme")).json()
        assert pending["deletion_pending"] is True and pending["deletion_requested_at"] > 0
        assert not pending["suffix_index"]
        assert control.pending_deletions("acme") == ["acme"]  # what the tenant's trainer reads
        control.complete_deletion("acme")  # the trainer, once replay and checkpoints are rewritten
        assert asyncio.run(get("acme")).json()["deletion_pending"] is False
        assert asyncio.run(get("nobody")).json()["known"] is False
    finally:
        control.close()
