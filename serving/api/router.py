"""Public routes: the OpenAI-compatible API, health and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from feedback.background.supervise import LOOPS
from serving.api.openai_serving import OpenAIServing
from serving.api.protocol import ChatCompletionRequest, CompletionRequest
from serving.api.responses import ModelCard, ModelList
from serving.api.tenants import resolve_tenant

router = APIRouter()


def _serving(raw: Request) -> OpenAIServing:
    return raw.app.state.openai_serving


async def _require_key(raw: Request) -> None:
    """With API keys configured every /v1 route needs a known key (README), the model list too.
    As a dependency it runs before the body is validated: without a key the answer is 401, not a
    400 or 404 that tells a stranger about the server. The handlers still match the key to the
    tenant the body claims."""
    resolve_tenant(_serving(raw).settings.api_keys, raw.headers.get("authorization"), None)


_KEYED = [Depends(_require_key)]


@router.post("/v1/completions", dependencies=_KEYED)
async def create_completion(body: CompletionRequest, raw: Request) -> Response:
    return await _serving(raw).completion(body, raw)


@router.post("/v1/chat/completions", dependencies=_KEYED)
async def create_chat_completion(body: ChatCompletionRequest, raw: Request) -> Response:
    return await _serving(raw).chat(body, raw)


@router.get("/v1/models", dependencies=_KEYED)
async def list_models(raw: Request) -> ModelList:
    return _serving(raw).models()


@router.get("/v1/models/{model:path}", dependencies=_KEYED)
async def retrieve_model(model: str, raw: Request) -> ModelCard:
    serving = _serving(raw)
    serving.check_model(model)
    return serving.models().data[0]


@router.get("/health")
async def health(raw: Request) -> Response:
    """200 while every background loop of this process runs; 503 naming the loops that are down
    (a crashed sink sender, Swapper watcher, ...) until their supervisor has restarted them."""
    serving = _serving(raw)
    drafter = getattr(serving.engine, "drafter", None)
    loops = getattr(raw.app.state, "loops", None) or LOOPS
    down = loops.down()
    body = {
        "status": "unhealthy" if down else "ok",
        "model": serving.served_model_name,
        "drafter": {
            "kind": getattr(drafter, "kind", None),
            "version": getattr(drafter, "version", None),
        },
        "loops_down": down,
    }
    return JSONResponse(body, status_code=503 if down else 200)


@router.get("/metrics")
async def metrics(raw: Request) -> Response:
    return Response(generate_latest(raw.app.state.metrics_registry), media_type=CONTENT_TYPE_LATEST)
