"""Assemble a ready-to-start engine from ServingSettings: target, drafter, trace sink, observers.

``specloop serve``, ``specloop generate``, the benchmarks and the demo all build engines here, so
a deployment is described by its settings alone. Tests and benchmarks may inject a target (e.g.
``tiny_target()``), a Prometheus registry or a trace sink instead.

``settings.engine`` picks TorchEngine (``torch``) or SGLangEngine (``sglang``); both get the same
observers (``build_observers``: metrics, trace recorder) and the same Swapper (``build_swapper``,
with the drafter loader that fits the engine). ``require_engine`` fails fast, with the install
command, when the engine's package is missing.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry

from feedback.bus.sink import InProcessTraceSink, TraceSink
from serving.config import ServingSettings
from serving.target import Target

log = logging.getLogger(__name__)


class EngineUnavailable(RuntimeError):
    """The configured engine cannot run here (e.g. ``engine=sglang`` without sglang installed)."""


def require_engine(engine: str) -> None:
    """Raise EngineUnavailable, saying how to install what is missing, unless ``engine`` can run.
    For sglang this reads the installed package's source (never imports it: that needs CUDA) and
    checks every hook point specloop relies on."""
    if engine != "sglang":
        return
    from serving.sglang.contract import SGLangContractError
    from serving.sglang.source_check import require_sglang

    try:
        require_sglang()
    except SGLangContractError as exc:
        raise EngineUnavailable(f"engine=sglang: {exc}") from exc


def build_observers(
    settings: ServingSettings,
    fingerprint,
    *,
    registry: CollectorRegistry | None = None,
    sink: TraceSink | None = None,
) -> list:
    """Prometheus metrics, plus a TraceRecorder when there is a sink (``sink``, else the one
    ``settings.trace_sink`` names): what every engine reports its verify steps to."""
    from serving.metrics import SpecMetrics
    from serving.observers import TraceRecorder

    observers: list = [SpecMetrics(registry)]
    sink = sink if sink is not None else build_trace_sink(settings)
    if sink is not None:
        observers.append(
            TraceRecorder(sink, fingerprint, record_features=settings.trace_features)
        )
    return observers


def build_drift_observer(settings: ServingSettings, replica_id: str, *, registry: CollectorRegistry | None = None,
                         domains=None, also_on_drift=None):
    """The replica's acceptance-drift observer (serving/ops_observer.py ``DriftObserver``), whatever
    else is configured: it counts drifts on ``specloop_acceptance_drift_total`` in ``registry``
    (default: the process's), announces them on Redis for the trainer when ``redis_url`` is set,
    and passes them to ``also_on_drift``. Register it on the engine (``engine.observers``); the ops
    observer, where there is one, listens to it (``build_ops_observer(drift=...)``). ``domains``:
    the DomainCap to share (default: one of ``max_tracked_domains``)."""
    from feedback.ops.domains import DomainCap
    from serving.ops_observer import DriftObserver, DriftPublisher

    listeners = []
    if settings.redis_url:
        listeners.append(DriftPublisher(build_control_plane(settings), settings.tenant, replica_id))
    if also_on_drift is not None:
        listeners.append(also_on_drift)
    return DriftObserver(registry=registry, listeners=listeners,
                         domains=domains if domains is not None else DomainCap(settings.max_tracked_domains))


def build_ops_observer(settings: ServingSettings, fingerprint, replica_id: str, drift, **run_options):
    """This replica's MLflow ops run and the observer feeding it (None without MLflow or with
    ``ops_log`` off). MLflow unreachable at start is never fatal: the run is then a ``PendingRun``,
    which opens itself once MLflow answers (metrics before that are dropped).
    ``drift``: the replica's DriftObserver (``build_drift_observer``, registered on the engine by
    the caller): the ops run records its drifts and tracks the same domains.
    ``run_options``: OpsRun options (e.g. ``flush_s``) and ``open_run_or_later``'s retry ones."""
    if not (settings.mlflow_tracking_uri and settings.ops_log):
        return None
    from feedback.ops.ops_log import open_run_or_later
    from serving.ops_observer import LiveOpsObserver

    run = open_run_or_later(settings.mlflow_tracking_uri, fingerprint, "serving", settings.tenant,
                            replica_id, **run_options)
    return LiveOpsObserver(run, every_s=settings.ops_every_s, drift=drift)


def build_control_plane(settings: ServingSettings):
    """The Redis control plane at ``redis_url`` under ``redis_namespace`` (the trainer's too)."""
    from feedback.control.plane import ControlPlane, ControlSettings

    return ControlPlane(ControlSettings(url=settings.redis_url, namespace=settings.redis_namespace))


def build_trace_sink(settings: ServingSettings) -> TraceSink | None:
    """The sink named by ``settings.trace_sink``; None for "none" (no trace capture at all)."""
    if settings.trace_sink == "none":
        return None
    if settings.trace_sink == "memory":
        return InProcessTraceSink()
    from feedback.bus.kafka_sink import KafkaTraceSink

    return KafkaTraceSink(
        bootstrap_servers=settings.kafka_bootstrap_servers, topic=settings.kafka_topic
    )


def build_engine(
    settings: ServingSettings,
    *,
    target: Target | None = None,
    registry: CollectorRegistry | None = None,
    sink: TraceSink | None = None,
    drafter=None,
):
    """The engine ``settings.engine`` names (not started).

    ``target``: use this target instead of loading ``settings.model`` (its dtype/device are kept;
    TorchEngine only).
    ``registry``: Prometheus registry for the engine's metrics (default: the process registry).
    ``sink``: trace sink to use instead of the one ``settings.trace_sink`` names.
    ``drafter``: serve with this drafter instead of the one ``settings.drafter`` names (TorchEngine;
    e.g. the demo's frozen snapshot, or a hybrid's suffix-only day 0).
    """
    if settings.engine == "sglang":
        if target is not None or drafter is not None:
            raise ValueError("target= and drafter= are for TorchEngine: SGLang loads its models itself")
        return build_sglang_engine(settings, registry=registry, sink=sink)
    from serving.drafters.factory import build_drafter
    from serving.engine.config import EngineConfig
    from serving.engine.torch_engine import TorchEngine
    from serving.target import load_target

    if settings.num_threads:
        import torch

        torch.set_num_threads(settings.num_threads)  # before loading: conversion uses it too
    if target is None:
        target = load_target(settings.model, dtype=settings.torch_dtype, device=settings.device)
    if drafter is None and (settings.k > 0 or settings.drafter_dir is not None):  # k=0: plain decoding
        drafter = build_drafter(settings.drafter, target, settings.drafter_dir)

    sink = sink if sink is not None else build_trace_sink(settings)
    observers = build_observers(settings, target.fingerprint, registry=registry, sink=sink)
    config = EngineConfig(
        max_batch_size=settings.max_batch_size,
        max_waiting=settings.max_waiting,
        k=settings.k,
        trace_topk=settings.trace_top_k,
        num_threads=settings.num_threads,
        capture_features=settings.trace_features,
        prefix_cache_tokens=settings.prefix_cache_tokens,
        bf16_activations=settings.bf16_activations,
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
    engine = TorchEngine(target, drafter, config=config, observers=observers, policy=policy)
    if engine.runner.prefix_cache is not None:
        from serving.metrics import watch_prefix_cache

        watch_prefix_cache(engine.runner.prefix_cache, registry)
    return engine


def sglang_config(settings: ServingSettings):
    """SGLangConfig (server arguments included) for ``settings`` (engine=sglang).

    Settings whose defaults are TorchEngine's CPU choices (dtype, max_batch_size, device) reach
    SGLang only when set explicitly; otherwise SGLang picks (checkpoint dtype, its own batch limit,
    the first visible GPU). ``sglang_server_args`` override everything derived here."""
    from serving.sglang.config import SGLangConfig
    from serving.target import resolve_model_path

    model_path, model_id = resolve_model_path(settings.model)
    server_args: dict = {"tp_size": settings.sglang_tp_size}
    if settings.sglang_mem_fraction_static is not None:
        server_args["mem_fraction_static"] = settings.sglang_mem_fraction_static
    if settings.explicitly_set("dtype"):
        server_args["dtype"] = settings.dtype
    if settings.explicitly_set("max_batch_size"):
        server_args["max_running_requests"] = settings.max_batch_size
    if settings.explicitly_set("device") and ":" in settings.device:
        server_args["base_gpu_id"] = int(settings.device.split(":", 1)[1])
    server_args.update(settings.sglang_server_args)
    return SGLangConfig(
        model_path=str(model_path),
        model_id=model_id,
        draft_path=str(settings.drafter_dir),
        algorithm=settings.sglang_algorithm,
        num_steps=settings.k,
        eagle_topk=settings.sglang_eagle_topk,
        num_draft_tokens=settings.sglang_num_draft_tokens,
        trace_sample_rate=settings.trace_sample_rate,
        trace_top_k=settings.trace_top_k,
        self_test=settings.sglang_self_test,
        server_args=server_args,
        max_waiting=settings.max_waiting,
    )


def build_sglang_engine(
    settings: ServingSettings,
    *,
    registry: CollectorRegistry | None = None,
    sink: TraceSink | None = None,
):
    """An SGLangEngine (not started; starting it launches SGLang on the GPU). Raises
    EngineUnavailable first thing when sglang is not installed or lacks a hook point."""
    require_engine("sglang")
    from serving.sglang.engine import SGLangEngine

    config = sglang_config(settings)
    engine = SGLangEngine(config)
    engine.load_metadata()  # tokenizer and fingerprint: the HTTP layer and traces need them
    sink = sink if sink is not None else build_trace_sink(settings)
    engine.observers.extend(
        build_observers(settings, engine.fingerprint, registry=registry, sink=sink)
    )
    log.info(
        "engine: SGLang %s, target %s, draft %s (%s), k=%d, traces -> %s (sample rate %.2f)",
        config.algorithm,
        config.model_id,
        config.draft_path,
        settings.drafter,
        settings.k,
        type(sink).__name__ if sink is not None else "none",
        settings.trace_sample_rate,
    )
    return engine


def build_draft_loader(settings: ServingSettings, engine, target: Target | None = None):
    """What turns a registry artifact into something ``engine.swap_drafter`` installs."""
    from serving.sglang.engine import SGLangEngine

    if isinstance(engine, SGLangEngine):
        from serving.sglang.drafts import SGLangDraftLoader

        return SGLangDraftLoader(engine)
    from serving.artifact_loader import ArtifactDrafterLoader

    return ArtifactDrafterLoader(target or engine.target, settings.drafter)


def build_swapper(settings: ServingSettings, engine, *, target: Target | None = None,
                  registry: CollectorRegistry | None = None, replica_id: str | None = None):
    """The drafter Swapper for ``engine`` (either engine) when ``redis_url`` or
    ``mlflow_tracking_uri`` is set, else None. Registers its live-acceptance observer on the engine
    (``engine.observers``). ``target``: TorchEngine's target (default ``engine.target``), for
    building drafters. ``replica_id``: the name its events and rollback announcements carry
    (default ``settings.replica_name()``)."""
    if not (settings.redis_url or settings.mlflow_tracking_uri):
        return None
    from serving.live_acceptance import LiveAcceptance
    from serving.swap import SwapConfig, Swapper

    control = drafters = None
    if settings.redis_url:
        control = build_control_plane(settings)
    if settings.mlflow_tracking_uri:
        from feedback.registry.drafter_registry import DrafterRegistry

        drafters = DrafterRegistry(settings.mlflow_tracking_uri)
    live = LiveAcceptance(registry=registry)
    engine.observers.append(live)
    loader = build_draft_loader(settings, engine, target)
    config = SwapConfig(
        tenant=settings.tenant,
        watch_steps=settings.swap_watch_steps,
        floor_ratio=settings.rollback_floor_ratio,
        poll_interval_s=settings.swap_poll_interval_s,
        replica_id=replica_id or settings.replica_name(),
    )
    return Swapper(engine, loader, live, registry=drafters, control=control, config=config,
                   metrics_registry=registry)
