"""/health is 503 naming the background loops that are down, 200 again once they run."""

from __future__ import annotations

import asyncio

import httpx
from prometheus_client import CollectorRegistry

from feedback.background.supervise import LoopRegistry
from serving.api.app import create_app
from serving.builder import build_engine
from serving.config import ServingSettings
from serving.target import tiny_target


def _get(app, path):
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.get(path)

    return asyncio.run(go())


def test_health_is_503_while_a_loop_is_down():
    settings = ServingSettings(served_model_name="tiny", drafter="suffix")
    registry = CollectorRegistry()
    engine = build_engine(settings, target=tiny_target(vocab_size=101), registry=registry)
    app = create_app(engine, settings, registry)
    app.state.loops = loops = LoopRegistry()
    sender = loops.register("kafka-trace-sink")
    ok = _get(app, "/health")
    assert ok.status_code == 200 and ok.json()["status"] == "ok"
    sender.backoff.initial_s = 0.0
    sender.failed(RuntimeError("sender crashed"))
    bad = _get(app, "/health")
    assert bad.status_code == 503
    body = bad.json()
    assert body["status"] == "unhealthy"
    assert "sender crashed" in body["loops_down"]["kafka-trace-sink"]["last_error"]
    sender.ok()
    assert _get(app, "/health").status_code == 200
