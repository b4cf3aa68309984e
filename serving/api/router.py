"""Public routes: the OpenAI-compatible API, health and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from serving.api.openai_serving import OpenAIServing
from serving.api.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList

router = APIRouter()


def _serving(raw: Request) -> OpenAIServing:
    return raw.app.state.openai_serving


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, raw: Request) -> Response:
    return await _serving(raw).completion(body, raw)


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, raw: Request) -> Response:
    return await _serving(raw).chat(body, raw)


@router.get("/v1/models")
async def list_models(raw: Request) -> ModelList:
    return _serving(raw).models()


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, raw: Request) -> ModelCard:
    serving = _serving(raw)
    serving.check_model(model)
    return serving.models().data[0]


@router.get("/health")
async def health(raw: Request) -> dict:
    serving = _serving(raw)
    drafter = getattr(serving.engine, "drafter", None)
    return {
        "status": "ok",
        "model": serving.served_model_name,
        "drafter": {
            "kind": getattr(drafter, "kind", None),
            "version": getattr(drafter, "version", None),
        },
    }


@router.get("/metrics")
async def metrics(raw: Request) -> Response:
    return Response(generate_latest(raw.app.state.metrics_registry), media_type=CONTENT_TYPE_LATEST)
