"""The FastAPI application around one engine."""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from prometheus_client import REGISTRY, CollectorRegistry
from starlette.exceptions import HTTPException

from serving.api.admin import admin_router
from serving.api.errors import error_body, install_error_handlers
from serving.api.openai_serving import OpenAIServing
from serving.api.router import router
from serving.config import ServingSettings
from serving.engine.base import Engine

log = logging.getLogger(__name__)



class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` is a 413 in OpenAI's error shape, refused
    from its Content-Length before it is read, or once a chunked body passes the limit. Parsing
    and tokenising megabytes holds up every other stream (and a 4.8 MB prompt took 7.6 s only to
    be refused as longer than the context)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        message = f"Request body too large: this server takes at most {self.max_bytes} bytes"
        length = dict(scope.get("headers") or ()).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            refusal = JSONResponse(error_body(message, "invalid_request_error"), status_code=413)
            return await refusal(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            event = await receive()
            if event["type"] == "http.request":
                seen += len(event.get("body", b""))
                if seen > self.max_bytes:  # FastAPI lets an HTTPException out of the body read
                    raise HTTPException(413, message)
            return event

        await self.app(scope, counted, send)


def _trace_sinks(engine: Engine) -> list:
    """The sinks the engine's TraceRecorders emit to, each once. The app closes them at shutdown:
    the Kafka sink sends what it still holds, or counts it as shed ("closed"); left open, its
    daemon sender thread died with the process and the traces with it, uncounted."""
    from serving.observers import TraceRecorder

    sinks: list = []
    for observer in getattr(engine, "observers", ()):
        sink = observer.sink if isinstance(observer, TraceRecorder) else None
        if sink is not None and all(sink is not s for s in sinks):
            sinks.append(sink)
    return sinks


def _close_sink(sink) -> None:
    try:
        sink.close()
    except Exception:  # a sink must not keep the rest of the shutdown from running
        log.exception("closing trace sink %s failed", type(sink).__name__)


def create_app(
    engine: Engine,
    settings: ServingSettings | None = None,
    registry: CollectorRegistry | None = None,
    swapper=None,
) -> FastAPI:
    """``registry``: the Prometheus registry the engine's metrics live in (served at /metrics).
    ``swapper``: a serving.swap.Swapper; by default one is built when the settings name Redis or
    MLflow (see serving.builder.build_swapper). Started and stopped with the app.
    The app owns the engine's trace sinks (its TraceRecorders'): they are closed at shutdown,
    after the engine stopped."""
    settings = settings or ServingSettings()
    replica = settings.replica_name()
    from serving.builder import build_drift_observer

    # acceptance drift, counted on /metrics and announced to the trainer (with Redis), MLflow or not
    drift = build_drift_observer(settings, replica, registry=registry)
    engine.observers.append(drift)
    if swapper is None and (settings.redis_url or settings.mlflow_tracking_uri):
        from serving.builder import build_swapper

        swapper = build_swapper(settings, engine, registry=registry, replica_id=replica)
    if elsewhere := settings.tenants_not_followed():
        log.warning("API keys map to tenants %s, but this server follows tenant %r's drafter "
                    "versions (SPECLOOP_TENANT) and a trainer trains one tenant: their traffic is "
                    "served and traced, not learned for", elsewhere, settings.tenant)
    reporter = None
    if settings.redis_url:  # serving's load heartbeats: the trainer trains on spare capacity
        from serving.builder import build_control_plane
        from serving.load_report import LoadReporter

        reporter = LoadReporter(engine, build_control_plane(settings), replica,
                                every_s=settings.heartbeat_s)

    from serving.drafters.suffix import suffix_part

    follower = None
    # Replicas share what they learn through their suffix indexes. The served kind decides for
    # good whether there is one (swaps keep it: serving/artifact_loader.py): an engine without
    # (SGLang, a learned drafter alone) would read the whole topic only to skip every record.
    if settings.trace_sink == "kafka" and settings.follow_traces \
            and suffix_part(getattr(engine, "drafter", None)) is not None:
        from feedback.bus.kafka_source import KafkaTraceSource
        from serving.trace_follow import TraceFollower

        follower = TraceFollower(engine, lambda: KafkaTraceSource(
            bootstrap_servers=settings.kafka_bootstrap_servers, topic=settings.kafka_topic,
            group_id=f"specloop-replica-{replica}", auto_offset_reset="latest",
            dead_letter=False), replica)  # the trainer dead-letters bad messages, once

    from serving.builder import build_ops_observer

    fingerprint = getattr(engine, "fingerprint", None)
    ops = build_ops_observer(settings, fingerprint, replica, drift) \
        if settings.mlflow_tracking_uri and fingerprint else None
    if ops is not None:  # the operators' view in MLflow, from the first request (issue 15)
        engine.observers.append(ops)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        await engine.start()
        if swapper is not None:
            swapper.start()
        if reporter is not None:
            reporter.start()
        if follower is not None:
            follower.start()
        try:
            yield
        finally:
            if follower is not None:
                await asyncio.to_thread(follower.stop)
            if reporter is not None:
                await asyncio.to_thread(reporter.stop)
            if swapper is not None:
                await asyncio.to_thread(swapper.stop)
            await engine.stop()
            # after the engine: its last traces (requests the stop aborted too) are emitted by now
            for sink in _trace_sinks(engine):
                await asyncio.to_thread(_close_sink, sink)
            if ops is not None:
                ops.flush()
                await asyncio.to_thread(ops.run.close)

    app = FastAPI(
        title="specloop", summary="OpenAI-compatible speculative decoding", lifespan=lifespan
    )
    app.state.openai_serving = OpenAIServing(engine, settings)
    app.state.swapper = swapper
    app.state.load_reporter = reporter
    app.state.trace_follower = follower
    app.state.ops_observer = ops
    app.state.drift_observer = drift
    app.state.metrics_registry = registry if registry is not None else REGISTRY
    app.state.admin_token = (
        settings.admin_token.get_secret_value() if settings.admin_token else None
    )
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.include_router(router)
    if app.state.admin_token:
        app.include_router(admin_router)
    return app
