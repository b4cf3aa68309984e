"""Admission control: the engine's queue is bounded; beyond it requests are refused at once with
HTTP 429 in OpenAI's error shape and a Retry-After header (streamed or not), and admitted requests
finish."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client import CollectorRegistry

from serving.api.app import create_app
from serving.builder import build_engine
from serving.config import ServingSettings
from serving.engine.admission import AdmissionGate
from serving.engine.base import GenerationRequest, Overloaded, RequestError, SamplingParams
from serving.engine.config import EngineConfig
from serving.engine.torch_engine import TorchEngine
from serving.target import tiny_target


def test_the_gate_bounds_requests_in_flight_at_running_plus_waiting():
    gate = AdmissionGate(max_running=2, max_waiting=1, retry_after_s=3.0)
    for rid in ("a", "b", "c"):
        gate.admit(rid)
    with pytest.raises(Overloaded, match="capacity") as err:
        gate.admit("d")
    assert err.value.retry_after_s == 3.0 and gate.refused == 1 and "d" not in gate
    gate.release("a")  # a finished request frees its place
    gate.admit("d")
    assert gate.in_flight == {"b", "c", "d"}
    with pytest.raises(RequestError, match="already running") as dup:
        gate.admit("b")
    assert dup.value.invalid and not isinstance(dup.value, Overloaded)
    gate.release("unknown")  # releasing twice, or what was never admitted, is harmless


@pytest.mark.parametrize("running, waiting", [(4, None), (None, 2)])
def test_the_gate_is_unbounded_without_both_sizes(running, waiting):
    gate = AdmissionGate(max_running=running, max_waiting=waiting)
    for i in range(100):
        gate.admit(f"r{i}")
    assert gate.limit is None and gate.refused == 0


def test_engine_refuses_beyond_batch_plus_waiting(ids_target):
    engine = TorchEngine(ids_target, None, EngineConfig(k=0, max_batch_size=1, max_waiting=1))

    async def one(i):
        req = GenerationRequest(request_id=f"r{i}", prompt_ids=[1, 2, 3],
                                params=SamplingParams(max_tokens=32, ignore_eos=True))
        return [c async for c in engine.generate(req)]

    async def main():
        await engine.start()
        try:
            return await asyncio.gather(*[one(i) for i in range(4)], return_exceptions=True)
        finally:
            await engine.stop()

    out = asyncio.run(main())
    refused = [o for o in out if isinstance(o, Overloaded)]
    done = [o for o in out if isinstance(o, list)]
    assert len(refused) == 2 and len(done) == 2, out  # one running + one waiting admitted
    assert all(sum(len(c.token_ids) for c in chunks) == 32 for chunks in done)
    assert engine.admission.refused == 2
    assert engine.admission.in_flight == set()  # nothing of the refused requests is kept


def _tiny_app(**settings):
    """An engine on the tiny target and the API app around it."""
    settings = ServingSettings(served_model_name="tiny", drafter="suffix", max_tokens_limit=400,
                               **settings)
    registry = CollectorRegistry()
    engine = build_engine(settings, target=tiny_target(), registry=registry)
    return engine, create_app(engine, settings, registry)


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=120)


@pytest.mark.parametrize("stream", [False, True])
def test_http_429_with_retry_after_when_the_engine_is_full(stream):
    engine, app = _tiny_app(max_batch_size=1, max_waiting=0)

    async def main():
        async with _client(app) as c:
            body = {"model": "tiny", "prompt": "hello", "max_tokens": 300, "ignore_eos": True}
            first = asyncio.ensure_future(c.post("/v1/completions", json=body))
            while not engine.admission.in_flight:
                await asyncio.sleep(0.005)
            second = await c.post("/v1/completions", json={**body, "max_tokens": 4, "stream": stream})
            ok = await first
            await engine.stop()
            return ok, second

    ok, refused = asyncio.run(main())
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 300
    assert refused.status_code == 429
    assert int(refused.headers["retry-after"]) >= 1
    err = refused.json()["error"]
    assert err["code"] == "rate_limit_exceeded" and err["type"] == "requests"
    assert "capacity" in err["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_http_503_with_retry_after_once_the_engine_is_stopping(stream):
    """A stopping replica refuses with 503 + Retry-After (a load balancer retries it elsewhere),
    not a 500; requests it had finished stay 200."""
    engine, app = _tiny_app()

    async def main():
        async with _client(app) as c:
            body = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "stream": stream}
            before = await c.post("/v1/completions", json=body)
            await engine.stop()
            return before, await c.post("/v1/completions", json=body)

    before, after = asyncio.run(main())
    assert before.status_code == 200
    assert after.status_code == 503, after.text
    assert int(after.headers["retry-after"]) >= 1
    err = after.json()["error"]
    assert err["code"] == "engine_unavailable" and "stopping" in err["message"]
