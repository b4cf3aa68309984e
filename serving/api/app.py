"""The FastAPI application around one engine."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

from fastapi import FastAPI
from prometheus_client import REGISTRY, CollectorRegistry

from serving.api.admin import admin_router
from serving.api.errors import install_error_handlers
from serving.api.openai_serving import OpenAIServing
from serving.api.router import router
from serving.config import ServingSettings
from serving.engine.base import Engine


def create_app(
    engine: Engine,
    settings: ServingSettings | None = None,
    registry: CollectorRegistry | None = None,
    swapper=None,
) -> FastAPI:
    """``registry``: the Prometheus registry the engine's metrics live in (served at /metrics).
    ``swapper``: a serving.swap.Swapper; by default one is built when the settings name Redis or
    MLflow (see serving.builder.build_swapper). Started and stopped with the app."""
    settings = settings or ServingSettings()
    if swapper is None and (settings.redis_url or settings.mlflow_tracking_uri):
        from serving.builder import build_swapper

        swapper = build_swapper(settings, engine, registry=registry)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        await engine.start()
        if swapper is not None:
            swapper.start()
        try:
            yield
        finally:
            if swapper is not None:
                await asyncio.to_thread(swapper.stop)
            await engine.stop()

    app = FastAPI(
        title="specloop", summary="OpenAI-compatible speculative decoding", lifespan=lifespan
    )
    app.state.openai_serving = OpenAIServing(engine, settings)
    app.state.swapper = swapper
    app.state.metrics_registry = registry if registry is not None else REGISTRY
    app.state.admin_token = (
        settings.admin_token.get_secret_value() if settings.admin_token else None
    )
    install_error_handlers(app)
    app.include_router(router)
    if app.state.admin_token:
        app.include_router(admin_router)
    return app
