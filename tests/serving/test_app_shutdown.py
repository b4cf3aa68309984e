"""The app's shutdown closes the engine's trace sink after the engine stopped: the Kafka sink's
queued traces are sent or counted as shed ("closed"), not lost with its daemon thread."""

from __future__ import annotations

import asyncio

import httpx
from prometheus_client import CollectorRegistry

from feedback.bus.kafka_sink import KafkaTraceSink
from infra.stack import free_port
from serving.api.app import create_app
from serving.builder import build_engine
from serving.config import ServingSettings
from serving.target import tiny_target


def test_shutdown_closes_the_trace_sink_after_the_engine_and_accounts_for_every_trace():
    # a broker nobody listens on: the request's trace stays queued until shutdown
    sink = KafkaTraceSink(bootstrap_servers=f"127.0.0.1:{free_port()}", topic="nowhere",
                          bootstrap_timeout_ms=300, max_block_ms=300, reconnect_backoff_s=0.2)
    settings = ServingSettings(served_model_name="tiny", drafter="suffix")
    engine = build_engine(settings, target=tiny_target(vocab_size=101), registry=CollectorRegistry(),
                          sink=sink)
    app = create_app(engine, settings, CollectorRegistry())
    order = []
    stop, close = engine.stop, sink.close

    async def recorded_stop():
        await stop()
        order.append("engine stopped")

    def recorded_close(*a, **kw):
        order.append("sink closed")
        close(*a, **kw)

    engine.stop, sink.close = recorded_stop, recorded_close

    async def serve_one_request():
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                         timeout=60) as c:
                r = await c.post("/v1/completions",
                                 json={"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 4})
            assert r.status_code == 200, r.text
            for _ in range(500):  # the trace is emitted on the engine thread after the last chunk
                if sink.emitted:
                    break
                await asyncio.sleep(0.01)
            assert sink.emitted == 1 and sink.pending == 1  # queued: no broker to send it to

    asyncio.run(serve_one_request())
    assert order == ["engine stopped", "sink closed"]
    assert sink.pending == 0
    assert sink.sent == 0 and sink.shed_by_reason["closed"] == 1  # counted, not vanished
