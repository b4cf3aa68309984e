"""What the Swappers of several replicas write about a version: one live-acceptance curve per
replica on the version's MLflow run (not one key every replica writes at its own step count), the
rollback watch's verdict on that run, and acceptance totals on Redis per tenant and version.

Real MLflow (sqlite in tmp_path) and Redis (``redis_server``); tiny random Llama target served by
TorchEngine; the registered version is a standalone copy of the target.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from swap_replicas import register_copy, replica

from feedback.control.plane import AcceptanceCounts, ControlPlane, ControlSettings
from feedback.registry.drafter_registry import DrafterRegistry, model_name
from serving.engine.base import GenerationRequest, SamplingParams
from serving.live_acceptance import VersionStats
from serving.target import tiny_target

V, LAYERS, TENANT = 128, 2, "curves"


@pytest.fixture(scope="module")
def target():
    return tiny_target(vocab_size=V, hidden_size=64, num_layers=LAYERS, seed=0)


@pytest.fixture
def registry(tmp_path):
    return DrafterRegistry(f"sqlite:///{tmp_path}/mlflow.db")


def _register(registry, target, path) -> str:
    return register_copy(registry, target, path, TENANT)


def _replica(target, registry, name, *, control=None, tenant=TENANT, watch_steps=16):
    return replica(target, registry, name, tenant, control=control, watch_steps=watch_steps)


async def _serve(engine, n: int, seed: int) -> None:
    async def one(i):
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        req = GenerationRequest(request_id=f"{seed}-{i}-{time.monotonic_ns()}",
                                prompt_ids=[(7 * i + j + seed) % V for j in range(5)], params=params)
        return [t async for c in engine.generate(req) for t in c.token_ids]

    await asyncio.gather(*[one(i) for i in range(n)])


async def _swap(engine, swapper, version) -> None:
    swapper.swap_to(version)
    deadline = time.monotonic() + 30  # installed between two steps; the deadline bounds a hang only
    while engine.drafter.version != version and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert engine.drafter.version == version


def _run_of(registry, version):
    return registry.client.get_model_version(model_name(TENANT), version).run_id


def test_each_replica_logs_its_own_live_curve_and_redis_sums_per_tenant(
        target, tmp_path, registry, redis_server, redis_namespace):
    v1 = _register(registry, target, tmp_path / "a")
    control = ControlPlane(ControlSettings(url=redis_server.url, namespace=redis_namespace))
    engine_a, a = _replica(target, registry, "replica-a", control=control)
    engine_b, b = _replica(target, registry, "replica-b", control=control)
    engine_c, c = _replica(target, registry, "replica-c", control=control, tenant="other")
    engines = (engine_a, engine_b, engine_c)

    async def main():
        for engine in engines:
            await engine.start()
        try:
            await _serve(engine_a, 2, seed=0)  # on day 0 first
            await _swap(engine_a, a, v1)
            await _swap(engine_b, b, v1)
            await _serve(engine_a, 3, seed=10)
            await _serve(engine_b, 2, seed=20)
            await _serve(engine_c, 2, seed=30)  # another tenant's day 0, in the same namespace
        finally:
            for engine in engines:
                await engine.stop()

    try:
        asyncio.run(main())
        for s in (a, b, c):
            s._flush_live()
            assert s.records.flush()
    finally:
        for s in (a, b, c):
            s.stop()
    run = registry.client.get_run(_run_of(registry, v1))
    assert "live_acceptance" not in run.data.metrics
    for name, s in (("replica-a", a), ("replica-b", b)):
        points = registry.client.get_metric_history(run.info.run_id, f"live_accept_len.{name}")
        stats = s.live.get(v1)
        assert [(p.step, p.value) for p in points] == [(stats.steps, pytest.approx(stats.ema))]
    rows = {(t, v): control.acceptance(t, v).rows for t, v in
            ((TENANT, "day0"), (TENANT, v1), ("other", "day0"), ("other", v1))}
    assert rows == {(TENANT, "day0"): a.live.get("day0").rows,
                    (TENANT, v1): a.live.get(v1).rows + b.live.get(v1).rows,
                    ("other", "day0"): c.live.get("day0").rows, ("other", v1): 0}
    assert all(n > 0 for (t, v), n in rows.items() if t == TENANT or v == "day0")
    assert control.acceptance("other", v1) == AcceptanceCounts()


def _watched(target, registry, tmp_path, name):
    """A replica that swapped v1 in after a predecessor that read 3.0 tokens per learned-draft row."""
    v1 = _register(registry, target, tmp_path / name)
    _, swapper = _replica(target, registry, name, watch_steps=4)
    swapper.live.recent = lambda version: [3.0] * 32
    swapper.swap_to(v1)
    return v1, swapper


def test_a_rollback_verdict_is_logged_on_the_watched_versions_run(target, tmp_path, registry):
    v1, swapper = _watched(target, registry, tmp_path, "bad")
    try:
        for _ in range(8):  # engine thread: far below its predecessor
            swapper.live.listener(v1, VersionStats(last_drafted=1.0))
        deadline = time.monotonic() + 30  # bounds a hang only
        while swapper.rollbacks == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert swapper.rollbacks == 1
        swapper._flush_live()
        assert swapper.records.flush()
    finally:
        swapper.stop()
    metrics = registry.client.get_run(_run_of(registry, v1)).data.metrics
    assert {k: v for k, v in metrics.items() if k.startswith("watch_")} == {
        "watch_live": 1.0, "watch_baseline": 3.0, "watch_floor": pytest.approx(2.4), "watch_steps": 4.0}


def test_a_kept_verdict_is_logged_on_the_watched_versions_run(target, tmp_path, registry):
    v1, swapper = _watched(target, registry, tmp_path, "good")
    try:
        for _ in range(8):
            swapper.live.listener(v1, VersionStats(last_drafted=3.5))
        swapper._flush_live()
        assert swapper.records.flush()
    finally:
        swapper.stop()
    assert swapper.rollbacks == 0 and swapper.version == v1
    metrics = registry.client.get_run(_run_of(registry, v1)).data.metrics
    assert {k: v for k, v in metrics.items() if k.startswith("watch_")} == {
        "watch_live": 3.5, "watch_baseline": 3.0, "watch_floor": pytest.approx(2.4), "watch_steps": 4.0}
