"""Assemble a ready-to-start engine from ServingSettings: target, drafter, trace sink, observers.

``specloop serve``, ``specloop generate``, the benchmarks and the demo all build engines here, so
a deployment is described by its settings alone. Tests and benchmarks may inject a target (e.g.
``tiny_target()``), a Prometheus registry or a trace sink instead.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry

from feedback.sink import InProcessTraceSink, TraceSink
from serving.config import ServingSettings
from serving.target import Target

log = logging.getLogger(__name__)


def build_trace_sink(settings: ServingSettings) -> TraceSink | None:
    """The sink named by ``settings.trace_sink``; None for "none" (no trace capture at all)."""
    if settings.trace_sink == "none":
        return None
    if settings.trace_sink == "memory":
        return InProcessTraceSink()
    from feedback.kafka_sink import KafkaTraceSink

    return KafkaTraceSink(
        bootstrap_servers=settings.kafka_bootstrap_servers, topic=settings.kafka_topic
    )


def build_engine(
    settings: ServingSettings,
    *,
    target: Target | None = None,
    registry: CollectorRegistry | None = None,
    sink: TraceSink | None = None,
):
    """A TorchEngine (not started) for ``settings``.

    ``target``: use this target instead of loading ``settings.model`` (its dtype/device are kept).
    ``registry``: Prometheus registry for the engine's metrics (default: the process registry).
    ``sink``: trace sink to use instead of the one ``settings.trace_sink`` names.
    """
    from serving.drafters.factory import build_drafter
    from serving.engine.config import EngineConfig
    from serving.engine.torch_engine import TorchEngine
    from serving.metrics import SpecMetrics
    from serving.observers import TraceRecorder
    from serving.target import load_target

    if settings.num_threads:
        import torch

        torch.set_num_threads(settings.num_threads)  # before loading: conversion uses it too
    if target is None:
        target = load_target(settings.model, dtype=settings.torch_dtype, device=settings.device)
    drafter = build_drafter(settings.drafter, target, settings.drafter_dir)

    observers: list = [SpecMetrics(registry)]
    sink = sink if sink is not None else build_trace_sink(settings)
    if sink is not None:
        observers.append(
            TraceRecorder(sink, target.fingerprint, record_features=settings.trace_features)
        )
    config = EngineConfig(
        max_batch_size=settings.max_batch_size,
        k=settings.k,
        num_threads=settings.num_threads,
        capture_features=settings.trace_features,
    )
    log.info(
        "engine: target %s, drafter %s (%s), k=%d, batch %d, traces -> %s",
        target.model_id,
        settings.drafter,
        settings.drafter_dir or "day 0",
        settings.k,
        settings.max_batch_size,
        type(sink).__name__ if sink is not None else "none",
    )
    policy = None
    if settings.adaptive_k:
        from serving.engine.goodput_policy import GoodputPolicy

        policy = GoodputPolicy(settings.k)
    return TorchEngine(target, drafter, config=config, observers=observers, policy=policy)


def build_swapper(settings: ServingSettings, engine, *, target: Target | None = None,
                  registry: CollectorRegistry | None = None):
    """The drafter Swapper for ``engine`` when ``redis_url`` or ``mlflow_tracking_uri`` is set,
    else None. Registers its live-acceptance observer on the engine (``engine.observers``).
    ``target``: the engine's target (default ``engine.target``), for building drafters."""
    if not (settings.redis_url or settings.mlflow_tracking_uri):
        return None
    from serving.swap import ArtifactDrafterLoader, LiveAcceptance, SwapConfig, Swapper

    control = drafters = None
    if settings.redis_url:
        from feedback.control import ControlPlane, ControlSettings

        control = ControlPlane(ControlSettings(url=settings.redis_url))
    if settings.mlflow_tracking_uri:
        from feedback.registry import DrafterRegistry

        drafters = DrafterRegistry(settings.mlflow_tracking_uri)
    live = LiveAcceptance(registry=registry)
    engine.observers.append(live)
    loader = ArtifactDrafterLoader(target or engine.target, settings.drafter)
    config = SwapConfig(
        tenant=settings.tenant,
        watch_steps=settings.swap_watch_steps,
        floor_ratio=settings.rollback_floor_ratio,
        poll_interval_s=settings.swap_poll_interval_s,
    )
    return Swapper(engine, loader, live, registry=drafters, control=control, config=config,
                   metrics_registry=registry)
