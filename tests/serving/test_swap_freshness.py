"""A swapped-in version says how fresh it is: from when the requests of the traces it was first
trained on finished (recorded in its artifact by the trainer) to its swap, in the Swapper's events
and on the version's MLflow run (sqlite registry in tmp_path)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from feedback.drafters.standalone_lm import StandaloneConfig, standalone_from_target
from feedback.registry.artifact import save_drafter
from feedback.registry.drafter_registry import DrafterRegistry, model_name
from serving.artifact_loader import ArtifactDrafterLoader
from serving.drafters.factory import build_drafter
from serving.engine.config import EngineConfig
from serving.engine.torch_engine import TorchEngine
from serving.live_acceptance import LiveAcceptance
from serving.registry_records import trace_freshness
from serving.swap import SwapConfig, Swapper
from serving.target import tiny_target

V, TENANT = 128, "fresh"


@pytest.fixture(scope="module")
def target():
    return tiny_target(vocab_size=V, hidden_size=64, num_layers=2, seed=0)


def _register(registry, target, path, extra):
    model = standalone_from_target(target.model, num_layers=1)
    cfg = StandaloneConfig.for_target(target.model.config, num_layers=1, vocab_size=V)
    save_drafter(model, cfg, target.fingerprint, path, version=path.name, extra=extra)
    return registry.register(TENANT, registry.log_candidate(target.fingerprint, path)).version


def test_a_swapped_in_version_logs_its_freshness_on_its_run(target, tmp_path):
    from prometheus_client import CollectorRegistry

    registry = DrafterRegistry(f"sqlite:///{tmp_path}/mlflow.db")
    now = time.time()
    fresh = _register(registry, target, tmp_path / "a", {"trace_finished_median_at": now - 30.0,
                                                          "trace_finished_newest_at": now - 5.0,
                                                          "window_traces": 12})
    untimed = _register(registry, target, tmp_path / "b", {})  # e.g. `specloop train --offline`
    metrics = CollectorRegistry()
    live = LiveAcceptance(registry=metrics)
    engine = TorchEngine(target, build_drafter("standalone", target, num_layers=1),
                         config=EngineConfig(max_batch_size=2, k=2), observers=[live])
    swapper = Swapper(engine, ArtifactDrafterLoader(target, "standalone"), live, registry=registry,
                      config=SwapConfig(tenant=TENANT, poll_interval_s=0), metrics_registry=metrics)
    try:
        swapper.swap_to(fresh, reason="announcement")  # as a promotion's announcement swaps it in
        swapped_at = time.time()
        swapper.swap_to(untimed, reason="announcement")
    finally:
        swapper.stop()  # writes what the swaps noted
    first, second = [e for e in swapper.events if e["event"] == "swap"]
    assert 30.0 <= first["freshness_s"] <= 30.0 + (swapped_at - now)
    assert 5.0 <= first["newest_trace_age_s"] <= 5.0 + (swapped_at - now)
    assert "freshness_s" not in second
    run = registry.client.get_run(registry.client.get_model_version(model_name(TENANT), fresh).run_id)
    assert run.data.metrics["freshness_s"] == pytest.approx(first["freshness_s"])
    assert run.data.metrics["newest_trace_age_s"] == pytest.approx(first["newest_trace_age_s"])
    other = registry.client.get_run(registry.client.get_model_version(model_name(TENANT), untimed).run_id)
    assert "freshness_s" not in other.data.metrics


def _swapper(target, registry, replica):
    from prometheus_client import CollectorRegistry

    metrics = CollectorRegistry()
    live = LiveAcceptance(registry=metrics)
    engine = TorchEngine(target, build_drafter("standalone", target, num_layers=1),
                         config=EngineConfig(max_batch_size=2, k=2), observers=[live])
    return Swapper(engine, ArtifactDrafterLoader(target, "standalone"), live, registry=registry,
                   config=SwapConfig(tenant=TENANT, poll_interval_s=0, replica_id=replica),
                   metrics_registry=metrics)


def test_freshness_is_logged_once_at_the_first_swap_after_the_promotion(target, tmp_path):
    """Not at a later swap of the version in the same process (an operator's, after a rollback),
    nor on a replica started after the promotion (the alias already on the version at its first
    poll); a version promoted while that replica polls is logged there."""
    from feedback.control.plane import SwapAnnouncement

    registry = DrafterRegistry(f"sqlite:///{tmp_path}/mlflow.db")
    now = time.time()
    times = {"trace_finished_median_at": now - 30.0, "trace_finished_newest_at": now - 5.0}
    v1 = _register(registry, target, tmp_path / "a", times)
    a = _swapper(target, registry, "replica-a")
    late = _swapper(target, registry, "replica-late")
    try:
        late.poll_once()  # started after v1's promotion: swaps it in from the alias
        assert late.version == v1
        a._on_announcement(SwapAnnouncement(tenant=TENANT, version=v1))  # the promotion's
        a.rollback(reason="operator")
        a.swap_to(v1, reason="announcement")  # not the first swap of v1 here
        a.rollback(reason="operator")
        a.swap_to(v1)  # an operator's
        v2 = _register(registry, target, tmp_path / "b", times)  # promoted while `late` polls
        late.poll_once()
        assert late.version == v2
    finally:
        a.stop()
        late.stop()
    swaps = [e for e in a.events + late.events if e["event"] == "swap"]
    assert [(e["version"], "freshness_s" in e) for e in swaps] == [
        (v1, True), (v1, False), (v1, False), (v1, False), (v2, True)]
    history = {}
    for version in (v1, v2):
        run_id = registry.client.get_model_version(model_name(TENANT), version).run_id
        history[version] = registry.client.get_metric_history(run_id, "freshness_s")
    assert [len(history[v1]), len(history[v2])] == [1, 1]
    assert history[v1][0].value == pytest.approx(swaps[0]["freshness_s"])
    assert history[v2][0].value == pytest.approx(swaps[-1]["freshness_s"])


def test_a_hybrids_freshness_is_its_learned_halfs():
    learned = SimpleNamespace(trace_times={"trace_finished_median_at": 100.0, "trace_finished_newest_at": 110.0})
    assert trace_freshness(SimpleNamespace(learned=learned), now=130.0) == {"freshness_s": 30.0,
                                                                            "newest_trace_age_s": 20.0}
    assert trace_freshness(SimpleNamespace(learned=None), now=130.0) == {}
    assert trace_freshness(torch.nn.Identity(), now=130.0) == {}
