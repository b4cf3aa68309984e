"""Drafter hot swap: announced versions go live mid-request (still lossless), bad drafters roll back
by themselves, refused artifacts never serve, admin routes, and serving survives Redis/MLflow down.

Real Redis (``redis_server``) and MLflow (``mlflow_server`` where the server matters, else a sqlite
registry in tmp_path). Target: a tiny random Llama on token ids; the "good" drafter is a
standalone copy of the whole target (accepts everything), the "bad" one has random weights.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from prometheus_client import CollectorRegistry

from feedback.control.plane import ControlPlane, ControlSettings, SwapAnnouncement
from feedback.drafters.standalone_lm import StandaloneConfig, standalone_from_target
from feedback.registry.artifact import save_drafter
from feedback.registry.drafter_registry import DrafterRegistry
from feedback.target.fingerprint import TargetFingerprint
from serving.artifact_loader import ArtifactDrafterLoader
from serving.drafters.factory import build_drafter
from serving.engine.base import GenerationRequest, SamplingParams
from serving.engine.config import EngineConfig
from serving.engine.reference import target_greedy_reference
from serving.engine.torch_engine import TorchEngine
from serving.live_acceptance import LiveAcceptance
from serving.observers import BaseObserver
from serving.swap import SwapConfig, Swapper
from serving.swap_errors import RefusedArtifact, UnknownVersion
from serving.target import tiny_target

V, LAYERS, TENANT = 128, 4, "swaptest"
PROMPTS = [[(7 * i + j) % V for j in range(5 + i)] for i in range(4)]


@pytest.fixture(scope="module")
def target():
    """Untied random lm_head: tied random tiny models just repeat the last token, which any
    drafter guesses, so a bad drafter would not look bad."""
    t = tiny_target(vocab_size=V, hidden_size=64, num_layers=LAYERS, seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        t.model.lm_head.weight = torch.nn.Parameter(torch.randn(V, 64, generator=gen) * 0.5)
    t.model.config.tie_word_embeddings = False
    return t


def _artifact(target, path, *, version, good=True, fingerprint=None):
    layers = LAYERS if good else 1
    model = standalone_from_target(
        target.model, num_layers=layers, init="target-layers" if good else "random", seed=11
    )
    cfg = StandaloneConfig.for_target(target.model.config, num_layers=layers, vocab_size=V)
    save_drafter(model, cfg, fingerprint or target.fingerprint, path, version=version)
    return path


def _register(registry, target, path):
    return registry.register(TENANT, registry.log_candidate(target.fingerprint, path)).version


@pytest.fixture
def sqlite_registry(tmp_path):
    return DrafterRegistry(f"sqlite:///{tmp_path}/mlflow.db")


class StepLog(BaseObserver):
    """drafter version of every step, per request. ``slow_until``: while it returns False, each
    step lingers ``linger_s`` on the step thread (at most ``max_linger_s`` in all), so that requests
    outlive something that happens between steps (a swap) however loaded the machine is."""

    def __init__(self):
        self.versions: dict[str, set[str]] = {}
        self.slow_until = None
        self.linger_s, self.max_linger_s, self.lingered_s = 0.05, 30.0, 0.0

    def on_step(self, batch):
        for rid in batch.request_ids:
            self.versions.setdefault(rid, set()).add(batch.drafter_version)
        if self.slow_until is not None and not self.slow_until() and self.lingered_s < self.max_linger_s:
            time.sleep(self.linger_s)
            self.lingered_s += self.linger_s


def _stack(target, *, registry=None, control=None, watch_steps=16, poll=0.0):
    day0 = build_drafter("standalone", target, num_layers=1, init="target-layers")
    metrics = CollectorRegistry()
    live, steps = LiveAcceptance(registry=metrics), StepLog()
    engine = TorchEngine(target, day0, config=EngineConfig(max_batch_size=8, k=4),
                         observers=[live, steps])
    swapper = Swapper(
        engine, ArtifactDrafterLoader(target, "standalone"), live, registry=registry,
        control=control,
        config=SwapConfig(tenant=TENANT, watch_steps=watch_steps, poll_interval_s=poll,
                          log_interval_s=0.5),
        metrics_registry=metrics,
    )
    return engine, swapper, steps


def _request(i, prompt, max_tokens=40):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return GenerationRequest(request_id=f"r{i}-{time.monotonic_ns()}", prompt_ids=prompt, params=params)


async def _serve(engine, requests):
    async def one(req):
        return req, [t async for c in engine.generate(req) for t in c.token_ids]

    return await asyncio.gather(*[one(r) for r in requests])


def _assert_lossless(target, results):
    for req, out in results:
        assert out == target_greedy_reference(target.model, req.prompt_ids, req.params.max_tokens)


async def _until(cond, timeout=30.0):
    """Waits for a background effect (no timing is asserted; the deadline only bounds a hang)."""
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return cond()


def _control(redis_server, ns):
    return ControlPlane(ControlSettings(url=redis_server.url, namespace=ns))


# ---- announced swap, in flight, lossless ---------------------------------------------------------


def test_announced_version_swaps_in_while_requests_are_in_flight(
    target, tmp_path, redis_server, redis_namespace, sqlite_registry
):
    good = _register(sqlite_registry, target, _artifact(target, tmp_path / "good", version="g"))
    control = _control(redis_server, redis_namespace)
    engine, swapper, steps = _stack(target, registry=sqlite_registry, control=control)
    steps.slow_until = lambda: engine.drafter.version == good  # requests still run when it lands

    async def main():
        await engine.start()
        swapper.start()
        assert swapper.wait_subscribed()
        try:
            requests = [_request(i, p, max_tokens=60) for i, p in enumerate(PROMPTS)]
            task = asyncio.ensure_future(_serve(engine, requests))
            assert await _until(lambda: engine.steps >= 2)
            control.announce_swap(SwapAnnouncement(tenant=TENANT, version=good))
            results = await task
            return requests, results
        finally:
            swapper.stop()
            await engine.stop()

    requests, results = asyncio.run(main())
    assert swapper.version == good and engine.drafter.version == good
    # at least one request ran steps under both drafters, and every output is target-greedy
    assert any(steps.versions[r.request_id] == {"day0", good} for r in requests)
    _assert_lossless(target, results)
    # one swap, not rolled back (the watch of the new version may have kept it by now)
    assert swapper.swaps == 1 and [e["event"] for e in swapper.events if e["event"] != "kept"][-1] == "swap"


def test_champion_alias_is_polled_when_no_announcement_arrives(target, tmp_path, sqlite_registry):
    good = _register(sqlite_registry, target, _artifact(target, tmp_path / "good", version="g"))
    engine, swapper, _ = _stack(target, registry=sqlite_registry, control=None, poll=0.2)
    swapper.start()
    try:
        asyncio.run(_until(lambda: swapper.version == good))
    finally:
        swapper.stop()
    assert engine.drafter.version == good


# ---- automatic rollback -------------------------------------------------------------------------


def test_bad_drafter_is_rolled_back_by_itself(target, tmp_path, redis_server, redis_namespace,
                                              mlflow_server):
    registry = DrafterRegistry(mlflow_server.url)
    good = _register(registry, target, _artifact(target, tmp_path / "good", version="g"))
    bad = _register(registry, target, _artifact(target, tmp_path / "bad", version="b", good=False))
    registry.set_champion(TENANT, good)
    control = _control(redis_server, redis_namespace)
    listener = _control(redis_server, redis_namespace).subscribe()
    assert listener.wait_subscribed()
    engine, swapper, _ = _stack(target, registry=registry, control=control, watch_steps=12)

    async def main():
        await engine.start()
        swapper.start()
        assert swapper.wait_subscribed()
        try:
            swapper.swap_to(good)
            await _serve(engine, [_request(i, p) for i, p in enumerate(PROMPTS)])  # good's baseline
            registry.set_champion(TENANT, bad)
            control.announce_swap(SwapAnnouncement(tenant=TENANT, version=bad, previous_version=good))
            assert await _until(lambda: swapper.version == bad)
            served = []
            for round_ in range(10):  # keep traffic up until the watch decides
                served += await _serve(engine, [_request(i, p) for i, p in enumerate(PROMPTS)])
                if await _until(lambda: swapper.rollbacks > 0, timeout=0.5):
                    break
            return served
        finally:
            swapper.stop()
            await engine.stop()

    try:
        served = asyncio.run(main())
        announcements = [listener.get(timeout=5.0) for _ in range(3)]
    finally:
        listener.close()
    _assert_lossless(target, served[:4])
    assert swapper.rollbacks == 1
    assert swapper.version == good and engine.drafter.version == good
    assert registry.champion(TENANT).version == good  # alias moved back
    rb = [a for a in announcements if a is not None and a.kind == "rollback"]
    assert rb and rb[0].from_version == bad and rb[0].to_version == good
    assert rb[0].live_acceptance < rb[0].floor
    assert control.get_drafter_version(TENANT) == good
    tags = registry.client.get_model_version(f"specloop-drafter-{TENANT}", bad).tags
    assert any("rolled back" in v for v in tags.values())
    assert swapper._c.rollbacks._value.get() == 1
    # MLflow has this replica's live acceptance for the good version, and the watch's verdict on bad
    mv = registry.client.get_model_version(f"specloop-drafter-{TENANT}", good)
    assert registry.client.get_metric_history(mv.run_id, f"live_accept_len.{swapper.config.replica_id}")
    verdict = registry.client.get_run(
        registry.client.get_model_version(f"specloop-drafter-{TENANT}", bad).run_id).data.metrics
    assert verdict["watch_live"] == pytest.approx(rb[0].live_acceptance)
    assert verdict["watch_floor"] == pytest.approx(rb[0].floor)


def test_a_good_successor_is_kept(target, tmp_path, sqlite_registry):
    v1 = _register(sqlite_registry, target, _artifact(target, tmp_path / "a", version="a"))
    v2 = _register(sqlite_registry, target, _artifact(target, tmp_path / "b", version="b"))
    engine, swapper, _ = _stack(target, registry=sqlite_registry, watch_steps=8)

    async def main():
        await engine.start()
        swapper.start()
        try:
            for v in (v1, v2):
                swapper.swap_to(v)  # from the event loop: installed between two later steps
                await _until(lambda v=v: engine.drafter.version == v, timeout=5.0)
                await _serve(engine, [_request(i, p) for i, p in enumerate(PROMPTS)])
            await _until(lambda: any(e["event"] == "kept" and e["version"] == v2
                                     for e in swapper.events), timeout=5.0)
        finally:
            swapper.stop()
            await engine.stop()

    asyncio.run(main())
    assert swapper.rollbacks == 0 and swapper.version == v2
    assert any(e["event"] == "kept" and e["version"] == v2 for e in swapper.events)


# ---- refused artifacts --------------------------------------------------------------------------


def test_corrupt_and_foreign_artifacts_are_refused_and_the_old_drafter_stays(
    target, tmp_path, sqlite_registry
):
    corrupt_dir = _artifact(target, tmp_path / "corrupt", version="c")
    weights = corrupt_dir / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF
    weights.write_bytes(bytes(data))
    corrupt = _register(sqlite_registry, target, corrupt_dir)
    other = TargetFingerprint(model_id="other-model", tokenizer_hash="cd" * 8, vocab_size=V)
    foreign = _register(
        sqlite_registry, target, _artifact(target, tmp_path / "foreign", version="f", fingerprint=other)
    )
    engine, swapper, _ = _stack(target, registry=sqlite_registry)
    before = engine.drafter
    with pytest.raises(RefusedArtifact, match="checksum"):
        swapper.swap_to(corrupt)
    with pytest.raises(RefusedArtifact, match="built for target"):
        swapper.swap_to(foreign)
    with pytest.raises(UnknownVersion):
        swapper.swap_to("999")
    assert engine.drafter is before and swapper.version == "day0"
    assert swapper.refused == 2 and swapper._c.refused._value.get() == 2
    assert swapper.records.flush()  # registry records are written off the swapping thread
    tags = sqlite_registry.client.get_model_version(f"specloop-drafter-{TENANT}", corrupt).tags
    assert any(v.startswith("refused") for v in tags.values())
    # an announcement of a refused version is not retried and changes nothing
    swapper._on_announcement(SwapAnnouncement(tenant=TENANT, version=corrupt))
    assert engine.drafter is before and swapper.refused == 2


def test_a_version_is_a_registry_number_or_unknown(target, tmp_path, sqlite_registry):
    """What an operator may type: anything else than a registry version is a clear 404 (not a
    503 "registry unavailable", nor a 500), and " 01" is version 1, not a version of its own."""
    good = _register(sqlite_registry, target, _artifact(target, tmp_path / "good", version="g"))
    engine, swapper, _ = _stack(target, registry=sqlite_registry)
    before = engine.drafter
    for bad in ("abc", "a/b", "../x", "", "1.0", "-1"):
        with pytest.raises(UnknownVersion, match="registry versions are whole numbers"):
            swapper.swap_to(bad)
    assert engine.drafter is before and swapper.refused == 0
    assert swapper.swap_to(f" 0{good}") == {"version": good, "previous_version": "day0", "changed": True}
    assert engine.drafter.version == good and swapper.version == good
    assert swapper.swap_to(good)["changed"] is False


def test_a_champion_whose_download_failed_is_tried_again_at_the_next_poll(target, tmp_path, sqlite_registry):
    """A registry outage while fetching an announced or polled champion is not a refusal: the
    next poll tries the same version again (the module's promise: retried at the next poll)."""
    good = _register(sqlite_registry, target, _artifact(target, tmp_path / "good", version="g"))
    engine, swapper, _ = _stack(target, registry=sqlite_registry)
    download, calls = sqlite_registry.download, []

    def flaky(tenant, version=None, dst=None):
        calls.append(version)
        if len(calls) <= 2:
            raise ConnectionError("artifact store unreachable")
        return download(tenant, version, dst)

    sqlite_registry.download = flaky
    swapper._on_announcement(SwapAnnouncement(tenant=TENANT, version=good))
    swapper.poll_once()
    assert engine.drafter.version == "day0" and calls == [good, good]
    swapper.poll_once()
    assert engine.drafter.version == good and swapper.version == good and len(calls) == 3
    swapper.poll_once()  # the alias has not moved since: nothing more to fetch
    assert len(calls) == 3


def test_downloads_are_deleted_once_loaded_or_refused(target, tmp_path, sqlite_registry):
    """A swap keeps no copy of the artifact on disk (the drafter is in memory)."""
    good = _register(sqlite_registry, target, _artifact(target, tmp_path / "good", version="g"))
    corrupt_dir = _artifact(target, tmp_path / "corrupt", version="c")
    (corrupt_dir / "model.safetensors").write_bytes(b"not safetensors")
    corrupt = _register(sqlite_registry, target, corrupt_dir)
    engine, swapper, _ = _stack(target, registry=sqlite_registry)
    downloads = []
    download = sqlite_registry.download

    def recording(tenant, version=None, dst=None):
        path, reg = download(tenant, version, dst)
        downloads.append(path)
        return path, reg

    sqlite_registry.download = recording
    with pytest.raises(RefusedArtifact):
        swapper.swap_to(corrupt)
    swapper.swap_to(good)
    assert engine.drafter.version == good
    assert len(downloads) == 2 and not any(p.exists() for p in downloads)


def test_artifacts_are_loaded_on_a_background_thread_that_computes_alone(target, tmp_path, sqlite_registry):
    """The download, checks and build run on the Swapper's loader thread, niced and with its
    tensor work on itself (one OpenMP thread), not on the caller's thread."""
    import threading

    version = _register(sqlite_registry, target, _artifact(target, tmp_path / "a", version="a"))
    engine, swapper, _ = _stack(target, registry=sqlite_registry)
    seen = {}
    load = swapper.loader.load

    def recording(path, current=None):
        seen.update(thread=threading.current_thread(), threads=torch.get_num_threads())
        return load(path, current)

    swapper.loader.load = recording
    swapper.swap_to(version)
    assert engine.drafter.version == version
    assert seen["thread"] is not threading.current_thread()
    assert seen["thread"].name.startswith("drafter-load") and seen["threads"] == 1
    swapper.stop()
    assert not seen["thread"].is_alive() or _joins(seen["thread"])


def _hold_downloads(swapper):
    """Each artifact load waits for ``release`` (set ``downloading`` first): a slow registry."""
    import threading

    release, downloading = threading.Event(), threading.Event()
    load = swapper.loader.load

    def slow(path, current=None):
        downloading.set()
        assert release.wait(30)
        return load(path, current)

    swapper.loader.load = slow
    return release, downloading


def test_a_rollback_does_not_wait_for_a_download_in_progress(target, tmp_path, sqlite_registry):
    """An operator's rollback (or the watch's) while the registry is slow to hand over the next
    version returns at once; the download, once done, still installs what was asked."""
    import threading

    first = _register(sqlite_registry, target, _artifact(target, tmp_path / "a", version="a"))
    second = _register(sqlite_registry, target, _artifact(target, tmp_path / "b", version="b"))
    engine, swapper, _ = _stack(target, registry=sqlite_registry)
    swapper.swap_to(first)
    release, downloading = _hold_downloads(swapper)
    result = {}
    swapping = threading.Thread(target=lambda: result.update(swapper.swap_to(second)))
    swapping.start()
    try:
        assert downloading.wait(30)
        done = {}
        rolling = threading.Thread(target=lambda: done.update(swapper.rollback(reason="operator")))
        rolling.start()
        rolling.join(5)
        assert done == {"from_version": first, "to_version": "day0"}  # not behind the download
        assert engine.drafter.version == "day0"
    finally:
        release.set()
        swapping.join(30)
    assert result == {"version": second, "previous_version": "day0", "changed": True}
    assert engine.drafter.version == second and swapper.status()["previous_version"] == "day0"
    swapper.stop()


def test_the_watchs_rollback_does_not_wait_for_the_worker_s_download(target, tmp_path, sqlite_registry):
    """The watch judged the live version bad while the Swapper's worker was downloading the next
    champion (a poll): the rollback happens at once, not once the download is done."""
    from serving.live_acceptance import VersionStats

    first = _register(sqlite_registry, target, _artifact(target, tmp_path / "a", version="a"))
    second = _register(sqlite_registry, target, _artifact(target, tmp_path / "b", version="b"))
    engine, swapper, _ = _stack(target, registry=sqlite_registry, watch_steps=4, poll=0.05)
    swapper.live.recent = lambda version: [3.0] * 32  # the predecessor's accept lengths
    swapper.swap_to(first)
    sqlite_registry.set_champion(TENANT, second)
    release, downloading = _hold_downloads(swapper)
    swapper.start()
    try:
        assert downloading.wait(30)  # the worker is in the poll's download of `second`
        for _ in range(64):  # engine thread: the live version drafts far worse than its predecessor
            swapper.live.listener(first, VersionStats(last_drafted=1.0))
        deadline = time.monotonic() + 10
        while swapper.rollbacks == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert swapper.rollbacks == 1 and engine.drafter.version == "day0"
        assert downloading.is_set() and not release.is_set()  # the download was still held
    finally:
        release.set()
        swapper.stop()


def test_a_version_that_cannot_be_built_is_refused_not_an_error(target, tmp_path, sqlite_registry):
    """torch's RuntimeError (or a MemoryError) while building a version escaped as a 500 from the
    admin route, and from an announcement or a poll it failed the Swapper's loop (/health down)
    and the version was fetched again at every poll."""
    version = _register(sqlite_registry, target, _artifact(target, tmp_path / "a", version="a"))
    engine, swapper, _ = _stack(target, registry=sqlite_registry)

    def cannot(path, current=None):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    swapper.loader.load = cannot
    with pytest.raises(RefusedArtifact, match="can't allocate memory"):
        swapper.swap_to(version)
    assert engine.drafter.version == "day0" and swapper.refused == 1
    assert swapper.swap_to(version, force=False)["changed"] is False  # not fetched again unasked
    swapper.stop()


def _joins(thread, timeout: float = 5.0) -> bool:
    thread.join(timeout)
    return not thread.is_alive()


# ---- admin routes -------------------------------------------------------------------------------


def test_admin_drafter_routes(target, tmp_path, sqlite_registry):
    from fastapi.testclient import TestClient

    from serving.api.app import create_app
    from serving.config import ServingSettings

    good = _register(sqlite_registry, target, _artifact(target, tmp_path / "good", version="g"))
    bad_dir = _artifact(target, tmp_path / "nan", version="n")
    (bad_dir / "model.safetensors").write_bytes(b"garbage")
    broken = _register(sqlite_registry, target, bad_dir)
    engine, swapper, _ = _stack(target, registry=sqlite_registry)
    metrics = CollectorRegistry()
    settings = ServingSettings(admin_token="tok", model="tiny")
    app = create_app(engine, settings, registry=metrics, swapper=swapper)
    auth = {"Authorization": "Bearer tok"}
    with TestClient(app) as http:
        assert http.get("/admin/drafter").status_code == 401
        assert http.post("/admin/drafter/rollback").status_code == 401
        wrong = http.post("/admin/drafter/swap", json={"version": good},
                          headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 403
        info = http.get("/admin/drafter", headers=auth).json()
        assert info["version"] == "day0" and info["kind"] == "standalone"
        assert http.post("/admin/drafter/rollback", headers=auth).status_code == 409
        missing = http.post("/admin/drafter/swap", json={"version": "42"}, headers=auth)
        assert missing.status_code == 404 and "42" in missing.json()["error"]["message"]
        refused = http.post("/admin/drafter/swap", json={"version": broken}, headers=auth)
        assert refused.status_code == 422 and "checksum" in refused.json()["error"]["message"]
        ok = http.post("/admin/drafter/swap", json={"version": int(good)}, headers=auth)  # a number too
        assert ok.status_code == 200 and ok.json()["previous_version"] == "day0"
        done = http.post("/v1/completions", json={"model": engine.model_name, "prompt": PROMPTS[0],
                                                  "max_tokens": 8}, headers=auth)
        info = http.get("/admin/drafter", headers=auth).json()
        assert info["version"] == good and info["previous_version"] == "day0"
        stale = http.post("/admin/drafter/rollback", json={"from_version": "day0"}, headers=auth)
        assert stale.status_code == 409 and f"version {good} is live" in stale.json()["error"]["message"]
        assert http.get("/admin/drafter", headers=auth).json()["version"] == good  # untouched
        back = http.post("/admin/drafter/rollback", json={"from_version": int(good)}, headers=auth)
        assert back.status_code == 200 and back.json() == {"from_version": good, "to_version": "day0"}
        assert http.get("/admin/drafter", headers=auth).json()["version"] == "day0"
    assert done.status_code == 200, done.text
    assert swapper.rollbacks == 1


# ---- degraded control plane ---------------------------------------------------------------------


def test_redis_and_mlflow_down_serving_keeps_its_drafter(target):
    dead_redis = ControlPlane(ControlSettings(url="redis://127.0.0.1:1/0", socket_timeout_s=0.2))
    dead_mlflow = DrafterRegistry("http://127.0.0.1:1")
    engine, swapper, _ = _stack(target, registry=dead_mlflow, control=dead_redis, poll=0.1)
    before = engine.drafter

    async def main():
        await engine.start()
        swapper.start()
        try:
            results = await _serve(engine, [_request(i, p) for i, p in enumerate(PROMPTS)])
            await asyncio.sleep(0.5)  # a few failed polls and flushes
            return results
        finally:
            swapper.stop()
            await engine.stop()

    results = asyncio.run(main())
    _assert_lossless(target, results)
    assert engine.drafter is before and swapper.version == "day0" and swapper.swaps == 0
