"""Tenants: API keys map to tenants, a client cannot claim another tenant, the tenant selects its
own suffix index; default secrets are refused outside dev mode (settings and the MLflow image)."""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry

from feedback.bus.sink import InProcessTraceSink
from feedback.secrets import DefaultSecretError
from serving.api.app import create_app
from serving.builder import build_engine
from serving.config import ServingSettings
from serving.target import tiny_target
from trainer.config import TrainerSettings

ROOT = Path(__file__).resolve().parents[2]
KEYS = {"key-acme-123": "acme", "key-beta-456": "beta"}


@pytest.fixture(scope="module")
def served():
    settings = ServingSettings(served_model_name="tiny", drafter="suffix", api_keys=KEYS)
    sink = InProcessTraceSink()
    engine = build_engine(settings, target=tiny_target(), registry=CollectorRegistry(), sink=sink)
    return create_app(engine, settings, CollectorRegistry()), engine, sink


def _post(app, body, key=None):
    async def go():
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                     timeout=60) as c:
            return await c.post("/v1/completions", json=body, headers=headers)

    return asyncio.run(go())


def _eventually(cond, timeout=5.0):
    """The index is fed on the engine thread just after the last chunk is sent."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


BODY = {"model": "tiny", "prompt": "one two three four five six", "max_tokens": 12}


def test_requests_need_a_known_key(served):
    app, _, _ = served
    for key in (None, "key-nobody"):
        r = _post(app, BODY, key)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_every_v1_route_needs_the_key_before_anything_else(served):
    """README: with keys set, every /v1 request needs one: the model list too, and a request
    without a key is a 401 whatever its body or model says (no 400/404 that probes the server)."""
    app, _, _ = served

    async def go(method, path, body=None, key=None):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                     timeout=60) as c:
            return await c.request(method, path, json=body, headers=headers)

    for method, path, body in [("GET", "/v1/models", None), ("GET", "/v1/models/tiny", None),
                               ("POST", "/v1/completions", {"prompt": 5}),
                               ("POST", "/v1/completions", {**BODY, "model": "nope"}),
                               ("POST", "/v1/chat/completions", {"messages": []})]:
        r = asyncio.run(go(method, path, body))
        assert r.status_code == 401, (path, body, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert asyncio.run(go("GET", "/v1/models", key="key-acme-123")).status_code == 200
    assert asyncio.run(go("GET", "/health")).status_code == 200  # probes and metrics stay open


def test_a_key_cannot_claim_another_tenant(served):
    app, _, _ = served
    r = _post(app, {**BODY, "tenant": "beta"}, "key-acme-123")
    assert r.status_code == 403
    assert "'acme'" in r.json()["error"]["message"] and r.json()["error"]["param"] == "tenant"


def test_the_key_chooses_the_tenant_and_its_suffix_index(served):
    app, engine, sink = served
    drafter = engine.drafter
    before = drafter.index("beta").num_tokens
    r = _post(app, BODY, "key-acme-123")
    assert r.status_code == 200
    assert _eventually(lambda: drafter.index("acme").num_tokens > 0)  # acme's output: acme's index
    assert drafter.index("beta").num_tokens == before
    (trace,) = sink.drain(10, 0.1)
    assert trace.tenant == "acme"
    assert _post(app, {**BODY, "tenant": "acme"}, "key-acme-123").status_code == 200


def test_without_keys_the_claimed_tenant_is_used_as_today():
    settings = ServingSettings(served_model_name="tiny", drafter="suffix")
    engine = build_engine(settings, target=tiny_target(), registry=CollectorRegistry())
    app = create_app(engine, settings, CollectorRegistry())
    assert _post(app, {**BODY, "tenant": "gamma"}).status_code == 200
    assert _eventually(lambda: engine.drafter.index("gamma").num_tokens > 0)


def test_default_secrets_are_refused_outside_dev_mode():
    with pytest.raises(ValueError, match="SPECLOOP_ADMIN_TOKEN is the published default"):
        ServingSettings(admin_token="change-me")
    with pytest.raises(ValueError, match="password in SPECLOOP_MLFLOW_TRACKING_URI"):
        ServingSettings(mlflow_tracking_uri="postgresql://mlflow:mlflow@db:5432/mlflow")
    with pytest.raises(ValueError, match="TRACKING_URI"):
        TrainerSettings(tracking_uri="postgresql://mlflow:mlflow@db:5432/mlflow")
    assert ServingSettings(admin_token="change-me", dev_mode=True).dev_mode
    assert ServingSettings(admin_token="a-real-token-9f2c").admin_token
    assert issubclass(DefaultSecretError, ValueError)


@pytest.mark.parametrize("password,dev,ok", [("mlflow", "0", False), ("mlflow", "1", True),
                                             ("s3cr3t-x", "0", True), ("", "0", False)])
def test_mlflow_image_refuses_the_default_database_password(password, dev, ok):
    script = ROOT / "infra/docker/mlflow-entrypoint.sh"
    out = subprocess.run(["sh", str(script), "true"], env={"POSTGRES_PASSWORD": password,
                         "SPECLOOP_DEV_MODE": dev, "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                         check=False)
    assert (out.returncode == 0) == ok, out.stderr
