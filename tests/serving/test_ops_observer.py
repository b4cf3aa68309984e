"""Serving's live figures and events reach MLflow from the first requests, off the engine thread."""

from __future__ import annotations

import time

import pytest
from mlflow.tracking import MlflowClient
from prometheus_client import CollectorRegistry

from feedback.ops.ops_log import open_run
from serving.drafters.suffix import SuffixDrafter
from serving.engine.base import GenerationRequest, SamplingParams
from serving.engine.config import EngineConfig
from serving.engine.torch_engine import TorchEngine
from serving.ops_observer import LiveOpsObserver
from serving.target import tiny_target


def test_serving_figures_reach_mlflow_from_the_first_requests(tmp_path, run):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    target = tiny_target(vocab_size=64)
    ops = open_run(uri, target.fingerprint, "serving", "acme", "r1", flush_s=0.2)
    assert ops is not None
    obs = LiveOpsObserver(ops, every_s=0.0)
    engine = TorchEngine(target, SuffixDrafter(), EngineConfig(k=3), observers=[obs])
    reqs = [GenerationRequest(request_id=f"r{i}", prompt_ids=[1, 2, 3, 1, 2, 3, 1, 2],
                              params=SamplingParams(max_tokens=12), domain=dom)
            for i, dom in enumerate(["chat", "code", "code"])]
    run(engine, reqs)
    obs.flush()
    ops.close()
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(f"specloop/{target.fingerprint.key()}")
    runs = client.search_runs([exp.experiment_id])
    assert [r.info.run_name for r in runs] == ["serving-acme-r1"]
    got = runs[0].data
    assert got.tags["role"] == "serving" and got.tags["live_drafter"].startswith("suffix")
    for key in ("tokens_per_verify.chat", "tokens_per_verify.code", "k_mean", "spec_off_fraction",
                "step_ms", "event.drafter_change"):
        assert key in got.metrics, key
    history = client.get_metric_history(runs[0].info.run_id, "tokens_per_verify")
    assert len(history) >= 2 and all(h.value >= 1.0 for h in history)


def test_prometheus_acceptance_by_position_k_and_speculation_off():
    from types import SimpleNamespace

    import numpy as np
    from prometheus_client import CollectorRegistry

    from serving.metrics import SpecMetrics

    reg = CollectorRegistry()
    m = SpecMetrics(reg)
    m.on_step(SimpleNamespace(request_ids=["a", "b", "c"], num_drafted=np.array([3, 2, 0]),
                              num_accepted=np.array([2, 0, 0]), draft_ms=1.0, verify_ms=5.0,
                              draft_nodes=np.array([3, 2, 0])))

    def val(name, **labels):
        return reg.get_sample_value(name, labels or None)

    assert val("specloop_spec_position_drafted_total", position="1") == 2
    assert val("specloop_spec_position_accepted_total", position="1") == 1
    assert val("specloop_spec_position_accepted_total", position="2") == 1
    assert val("specloop_spec_position_drafted_total", position="3") == 1
    assert val("specloop_spec_position_accepted_total", position="3") is None
    assert val("specloop_spec_off_rows_total") == 1
    assert val("specloop_spec_draft_length_count") == 3 and val("specloop_spec_draft_length_sum") == 5
    assert val("specloop_spec_draft_nodes_total") == val("specloop_spec_drafted_tokens_total") == 5  # chains


def _step(draft_ms=None, verify_ms=None, drafted=2, accepted=1, rows=1):
    """A VerifyBatch of ``rows`` rows alike (one by default); without timings as SGLang's steps
    arrive (the defaults)."""
    import numpy as np

    from serving.engine.base import VerifyBatch

    timings = {} if draft_ms is None else {"draft_ms": draft_ms, "verify_ms": verify_ms}
    return VerifyBatch(request_ids=[f"r{i}" for i in range(rows)], positions=np.zeros(rows, np.int32),
                       num_drafted=np.full(rows, drafted, np.int16),
                       num_accepted=np.full(rows, accepted, np.int16), source=np.ones(rows, np.uint8),
                       draft_ids=np.zeros((rows, drafted), np.int32),
                       draft_probs=np.zeros((rows, drafted), np.float32),
                       emitted=[[7] * (accepted + 1) for _ in range(rows)], **timings)


def test_draft_and_verify_time_are_observed_only_when_the_engine_measured_them():
    from prometheus_client import CollectorRegistry

    from serving.metrics import SpecMetrics

    reg = CollectorRegistry()
    m = SpecMetrics(reg)
    m.on_step(_step())  # not measured: no observation, not a 0 ms one
    for name in ("specloop_spec_draft_ms_count", "specloop_spec_verify_ms_count"):
        assert reg.get_sample_value(name) == 0, name
    assert reg.get_sample_value("specloop_spec_verify_batches_total") == 1  # the step still counts

    m.on_step(_step(draft_ms=2.0, verify_ms=12.0))
    assert reg.get_sample_value("specloop_spec_draft_ms_count") == 1
    assert reg.get_sample_value("specloop_spec_draft_ms_sum") == 2.0
    assert reg.get_sample_value("specloop_spec_verify_ms_count") == 1
    assert reg.get_sample_value("specloop_spec_verify_ms_sum") == 12.0


class _Run:
    def __init__(self):
        self.points: list[dict] = []

    def metrics(self, values, step):
        self.points.append(values)

    def event(self, *args, **kwargs):
        pass

    def tag(self, *args):
        pass


def test_ops_step_ms_and_speedup_come_from_timed_steps_only():
    untimed = _Run()
    obs = LiveOpsObserver(untimed, every_s=3600)
    obs.on_step(_step(drafted=0, accepted=0))
    obs.on_step(_step())
    obs.flush()
    (point,) = untimed.points
    assert point["tokens_per_verify"] == 1.5
    assert "step_ms" not in point and "est_speedup" not in point

    timed = _Run()
    obs = LiveOpsObserver(timed, every_s=3600)
    obs.on_step(_step(draft_ms=0.0, verify_ms=10.0, drafted=0, accepted=0))  # plain step: 10 ms
    obs.on_step(_step(draft_ms=2.0, verify_ms=12.0))
    obs.on_step(_step())  # an untimed step counts for tokens, not for time (nor for the speedup)
    obs.flush()
    (point,) = timed.points
    assert point["step_ms"] == 12.0
    assert point["est_speedup"] == point["est_speedup.batch1"] == 3 * 10.0 / 24.0  # 3 tokens in 24 ms


def test_speedup_compares_steps_with_plain_steps_of_their_own_batch_size():
    """est_speedup was tokens per row x one average of every plain step, whatever its batch size,
    / the mean step: plain steps at batch 1 (10 ms) priced steps at batch 8 (~30 ms), and this
    window read 0.84 where both batch sizes ran ~1.4x plain decoding. Each batch size is now
    priced against its own plain steps, summed per bucket, and /metrics has the figure too."""
    from serving.ops_observer import DriftObserver

    reg = CollectorRegistry()
    obs = LiveOpsObserver(_Run(), every_s=3600, drift=DriftObserver(registry=reg))
    obs.on_step(_step(draft_ms=0.0, verify_ms=10.0, drafted=0, accepted=0))  # batch 1, plain: 10 ms
    obs.on_step(_step(draft_ms=1.0, verify_ms=11.0))  # batch 1: 2 tokens in 12 ms
    obs.on_step(_step(draft_ms=0.5, verify_ms=24.0, drafted=0, accepted=0, rows=8))  # a draft cut to nothing
    for _ in range(3):
        obs.on_step(_step(draft_ms=2.0, verify_ms=30.0, rows=8))  # batch 8: 16 tokens in 32 ms
    obs.flush()
    (point,) = obs.run.points
    batch1 = 10.0 * 3 / 22  # plain decoding: 3 tokens in 30 ms; 22 ms taken
    batch8 = 24.0 * (8 + 3 * 16) / 8 / (24.5 + 3 * 32)  # the plain figure is the verify's 24 ms
    assert point["est_speedup.batch1"] == pytest.approx(batch1)
    assert point["est_speedup.batch8-15"] == pytest.approx(batch8)
    assert point["est_speedup"] == pytest.approx((30 + 168) / (22 + 120.5))
    assert reg.get_sample_value("specloop_estimated_speedup", {"batch": "1"}) == pytest.approx(batch1)
    assert reg.get_sample_value("specloop_estimated_speedup", {"batch": "8-15"}) == pytest.approx(batch8)


def test_a_plain_figure_older_than_plain_max_age_s_estimates_nothing():
    """Once every step drafted, est_speedup divided by the last plain steps' figure for good, however
    long ago they ran. A batch size without a plain step in ``plain_max_age_s`` has no estimate, in
    MLflow and on /metrics (its gauge is removed, not left at its last value), until one comes."""
    from serving.ops_observer import DriftObserver

    reg = CollectorRegistry()
    obs = LiveOpsObserver(_Run(), every_s=3600, drift=DriftObserver(registry=reg))

    def gauge():
        return reg.get_sample_value("specloop_estimated_speedup", {"batch": "1"})

    obs.on_step(_step(draft_ms=0.0, verify_ms=10.0, drafted=0, accepted=0))
    obs.on_step(_step(draft_ms=1.0, verify_ms=11.0))
    obs.flush()
    assert obs.run.points[-1]["est_speedup.batch1"] == pytest.approx(30 / 22) == gauge()
    obs.plain_max_age_s = 0.01
    time.sleep(0.02)  # at least: the plain figure is older than its age now
    obs.on_step(_step(draft_ms=1.0, verify_ms=11.0))
    obs.flush()
    point = obs.run.points[-1]
    assert point["step_ms"] == 12.0 and not any(k.startswith("est_speedup") for k in point)
    assert gauge() is None
    obs.plain_max_age_s = 600.0
    obs.on_step(_step(draft_ms=0.0, verify_ms=12.0, drafted=0, accepted=0))  # a probe's plain step
    obs.on_step(_step(draft_ms=1.0, verify_ms=11.0))
    obs.flush()
    assert obs.run.points[-1]["est_speedup.batch1"] == pytest.approx(11.0 * 3 / 24) == gauge()


def test_specloop_serve_opens_its_replicas_ops_run(tmp_path):
    """`specloop serve` with an MLflow URI logs the replica's live figures from the first request,
    and closes the run when the server stops (issue 15)."""
    from fastapi.testclient import TestClient
    from prometheus_client import CollectorRegistry

    from feedback.bus.sink import InProcessTraceSink
    from serving.api.app import create_app
    from serving.builder import build_engine
    from serving.config import ServingSettings

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    target = tiny_target()
    settings = ServingSettings(drafter="suffix", k=3, default_max_tokens=8, mlflow_tracking_uri=uri,
                               tenant="acme", replica_id="replica-1", ops_every_s=0.05)
    registry = CollectorRegistry()
    engine = build_engine(settings, target=target, registry=registry, sink=InProcessTraceSink())
    app = create_app(engine, settings, registry)
    with TestClient(app) as client:
        for _ in range(2):
            r = client.post("/v1/chat/completions", json={
                "model": settings.served_model_name, "max_tokens": 8,
                "messages": [{"role": "user", "content": "one two three one two three"}]})
            assert r.status_code == 200, r.text
    assert app.state.ops_observer is not None
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(f"specloop/{target.fingerprint.key()}")
    (run,) = [r for r in client.search_runs([exp.experiment_id]) if r.data.tags.get("role") == "serving"]
    assert run.info.run_name == "serving-acme-replica-1" and run.info.status == "FINISHED"
    assert {"tokens_per_verify", "k_mean", "event.drafter_change"} <= set(run.data.metrics)


def _fast_detector():
    from feedback.ops.drift import DriftDetector

    return DriftDetector(fast_steps=4, slow_steps=64, min_steps=8, persist_steps=3, cooldown_steps=0)


def _drive_to_a_drift(observer, domain: str = "code") -> None:
    """Synthetic verify steps (as tests/infra/test_operators_view_browser.py drives them): one
    request of ``domain`` whose acceptance collapses after 60 steps."""
    from types import SimpleNamespace

    import numpy as np

    observer.on_request_start(GenerationRequest(request_id="d", prompt_ids=[1], params=SamplingParams(),
                                                domain=domain))
    for accepted in [3] * 60 + [0] * 20:
        observer.on_step(SimpleNamespace(request_ids=["d"], num_drafted=np.array([4]),
                                         num_accepted=np.array([accepted]), emitted=[[7] * (accepted + 1)],
                                         draft_ms=1.0, verify_ms=60.0))
    observer.on_request_finish(SimpleNamespace(request_id="d"), [], "stop", None)


def test_mlflow_away_at_start_still_announces_drifts(caplog):
    """With MLflow unreachable when the replica starts, the ops observer was not built, so no
    drift reached the trainer for the process's life; then it recorded nothing for its life. Now
    drifts are detected by an observer of their own, and the ops run, built all the same, opens
    once MLflow answers (tests/feedback/ops/test_ops_log.py) and records the drifts it hears."""
    import socket

    from feedback.ops.ops_log import PendingRun
    from serving.builder import build_drift_observer, build_ops_observer
    from serving.config import ServingSettings

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    heard = []
    settings = ServingSettings(drafter="suffix", mlflow_tracking_uri=f"http://127.0.0.1:{port}")
    fingerprint = tiny_target(vocab_size=64).fingerprint
    drift = build_drift_observer(settings, "r1", registry=CollectorRegistry(), also_on_drift=heard.append)
    obs = build_ops_observer(settings, fingerprint, "r1", drift)
    assert obs is not None and isinstance(obs.run, PendingRun) and obs.run.run_id is None
    assert obs.drift_observer is drift and drift.listeners == [heard.append, obs.record_drift]
    drift.detector = _fast_detector()
    _drive_to_a_drift(drift)  # the engine feeds the drift observer (it is registered on its own)
    obs.flush()
    assert [e.domain for e in heard] == ["code"] and heard == obs.drifts
    assert "no MLflow ops run" in caplog.text
    obs.run.close()


def test_client_domains_beyond_the_cap_are_counted_as_other(tmp_path):
    """A request's domain is the client's string: 1,000 of them made 2,003 metric keys in the ops
    run and 1,000 drift detector states, never dropped. The first ``max_tracked_domains`` are
    tracked, the rest are ``other``, in the ops run and the drift detector alike (one cap)."""
    from fastapi.testclient import TestClient
    from prometheus_client import CollectorRegistry

    from feedback.bus.sink import InProcessTraceSink
    from serving.api.app import create_app
    from serving.builder import build_engine
    from serving.config import ServingSettings

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    target = tiny_target()
    settings = ServingSettings(drafter="suffix", k=3, default_max_tokens=8, mlflow_tracking_uri=uri,
                               tenant="acme", replica_id="replica-1", ops_every_s=0.05, max_tracked_domains=2)
    registry = CollectorRegistry()
    engine = build_engine(settings, target=target, registry=registry, sink=InProcessTraceSink())
    app = create_app(engine, settings, registry)
    ops, drift = app.state.ops_observer, app.state.drift_observer
    assert ops is not None and ops.drift_observer is drift and ops.domains is drift.domains
    with TestClient(app) as client:
        for i in range(6):
            r = client.post("/v1/completions", json={
                "model": settings.served_model_name, "max_tokens": 8, "domain": f"user-text-{i}",
                "prompt": "one two three one two three one two three"})
            assert r.status_code == 200, r.text
    assert drift.domains.tracked == {"user-text-0", "user-text-1"}
    assert set(drift.detector.domains) <= {"user-text-0", "user-text-1", "other"}
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(f"specloop/{target.fingerprint.key()}")
    (run,) = [r for r in client.search_runs([exp.experiment_id]) if r.data.tags.get("role") == "serving"]
    per_domain = {k.split(".", 1)[1] for k in run.data.metrics if k.startswith("tokens_per_verify.")}
    assert per_domain == {"user-text-0", "user-text-1", "other"}


def test_a_drift_is_counted_once_in_the_apps_registry_and_logged_in_the_ops_run(tmp_path):
    """The app's drift observer is the one the ops run listens to: one count per drift, in the
    registry /metrics serves (it was the process's global registry), one drift in MLflow."""
    from prometheus_client import REGISTRY, CollectorRegistry

    from serving.api.app import create_app
    from serving.builder import build_engine
    from serving.config import ServingSettings

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    target = tiny_target()
    settings = ServingSettings(drafter="suffix", k=3, mlflow_tracking_uri=uri, tenant="acme",
                               replica_id="replica-1")
    registry = CollectorRegistry()
    engine = build_engine(settings, target=target, registry=registry)
    app = create_app(engine, settings, registry)
    drift = app.state.drift_observer
    assert drift in engine.observers and app.state.ops_observer in engine.observers
    global_before = REGISTRY.get_sample_value("specloop_acceptance_drift_total", {"domain": "code"})
    drift.detector = _fast_detector()
    _drive_to_a_drift(drift)
    app.state.ops_observer.run.close()
    assert registry.get_sample_value("specloop_acceptance_drift_total", {"domain": "code"}) == 1
    assert REGISTRY.get_sample_value("specloop_acceptance_drift_total", {"domain": "code"}) == global_before
    run = MlflowClient(tracking_uri=uri).get_run(app.state.ops_observer.run.run_id)
    assert run.data.metrics["event.drift"] == 1 and run.data.metrics["drift.code"] == 1


@pytest.mark.integration
def test_a_replica_with_redis_and_no_mlflow_detects_and_announces_drifts(redis_server, redis_namespace):
    """Drift was detected only beside an MLflow ops run: a Redis-only deployment never told its
    trainer of one, nor counted one. Now every replica has a drift observer of its own."""
    from prometheus_client import CollectorRegistry

    from feedback.control.plane import ControlPlane, ControlSettings, DriftAnnouncement
    from serving.api.app import create_app
    from serving.builder import build_engine
    from serving.config import ServingSettings

    settings = ServingSettings(drafter="suffix", k=3, redis_url=redis_server.url, redis_namespace=redis_namespace,
                               tenant="acme", replica_id="replica-1")
    registry = CollectorRegistry()
    engine = build_engine(settings, target=tiny_target(), registry=registry)
    app = create_app(engine, settings, registry)  # starts nothing
    drift = app.state.drift_observer
    assert app.state.ops_observer is None and drift in engine.observers
    heard: list = []
    subscription = ControlPlane(ControlSettings(url=redis_server.url, namespace=redis_namespace)).subscribe(
        heard.append)
    try:
        assert subscription.wait_subscribed(5.0)
        drift.detector = _fast_detector()
        _drive_to_a_drift(drift)
        deadline = time.monotonic() + 10  # bounds a hang; nothing timed is asserted
        while not heard and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        subscription.close()
    (msg,) = heard
    assert isinstance(msg, DriftAnnouncement) and (msg.tenant, msg.domain, msg.replica_id) == (
        "acme", "code", "replica-1")
    assert registry.get_sample_value("specloop_acceptance_drift_total", {"domain": "code"}) == 1
