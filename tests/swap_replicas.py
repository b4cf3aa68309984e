"""Replicas for Swapper tests (tests import it as ``swap_replicas``): a TorchEngine on a tiny
target with its day-0 standalone drafter and a Swapper on a real registry, and registered
standalone copies of the target to swap to."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from feedback.drafters.standalone_lm import StandaloneConfig, standalone_from_target
from feedback.registry.artifact import save_drafter
from serving.artifact_loader import ArtifactDrafterLoader
from serving.drafters.factory import build_drafter
from serving.engine.config import EngineConfig
from serving.engine.torch_engine import TorchEngine
from serving.live_acceptance import LiveAcceptance
from serving.swap import SwapConfig, Swapper


def register_copy(registry, target, path, tenant: str) -> str:
    """A new registered version of ``tenant``: a standalone copy of ``target``'s layers, saved at
    ``path`` (its name is the artifact's version)."""
    layers, vocab = target.model.config.num_hidden_layers, target.model.config.vocab_size
    model = standalone_from_target(target.model, num_layers=layers, init="target-layers")
    cfg = StandaloneConfig.for_target(target.model.config, num_layers=layers, vocab_size=vocab)
    save_drafter(model, cfg, target.fingerprint, path, version=path.name)
    return registry.register(tenant, registry.log_candidate(target.fingerprint, path)).version


def replica(target, registry, name: str, tenant: str, *, control=None, **config):
    """(engine, swapper) of replica ``name``: not started; no polling unless ``config`` says so."""
    day0 = build_drafter("standalone", target, num_layers=1, init="target-layers")
    metrics = CollectorRegistry()
    live = LiveAcceptance(registry=metrics)
    engine = TorchEngine(target, day0, config=EngineConfig(max_batch_size=4, k=2), observers=[live])
    settings = {"poll_interval_s": 0.0, **config}
    swapper = Swapper(engine, ArtifactDrafterLoader(target, "standalone"), live, registry=registry,
                      control=control, metrics_registry=metrics,
                      config=SwapConfig(tenant=tenant, replica_id=name, **settings))
    return engine, swapper
