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
