"""Operator routes under /admin, mounted only when an admin token is configured and guarded by
``Authorization: Bearer <token>`` (401 without one, 403 with a wrong one).

Drafter routes: ``GET /admin/drafter`` (current version, kind, live acceptance), ``POST
/admin/drafter/swap`` ``{"version": "3"}`` (same download + validation as an announced swap: 404
unknown version, 422 refused artifact with the reason, 503 registry down) and ``POST
/admin/drafter/rollback`` (409 when there is nothing to roll back to; an optional body
``{"from_version": "7"}`` rolls back only while 7 is live, 409 otherwise: a rollback meant for the
drafter an operator saw is not applied to one a poll installed meanwhile). Swap and rollback need
the Swapper (``app.state.swapper``; 409 without one).

Retention: ``DELETE /admin/tenants/{tenant}`` deletes a tenant's data (suffix index here; replay
and checkpoints in the trainer, asked through the control plane; 503 with Retry-After when the
control plane could not take the request: retry, dropping the index again is harmless; 404 for a
tenant the server cannot name, unless ``?force=true``); ``GET /admin/tenants/{tenant}`` says
whether its deletion is still pending."""

from __future__ import annotations

import asyncio
import hmac

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict

from serving.api.errors import APIError, unavailable


def require_admin(raw: Request) -> None:
    token = raw.app.state.admin_token
    scheme, _, given = raw.headers.get("authorization", "").partition(" ")
    if token is None or scheme.lower() != "bearer" or not given:
        raise APIError("missing admin token", 401, "authentication_error")
    if not hmac.compare_digest(given.encode(), token.encode()):
        raise APIError("invalid admin token", 403, "permission_error")


admin_router = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)])


class SwapBody(BaseModel):
    model_config = ConfigDict(coerce_numbers_to_str=True)  # {"version": 7}, as MLflow numbers them

    version: str


def _swapper(raw: Request):
    swapper = getattr(raw.app.state, "swapper", None)
    if swapper is None:
        raise APIError("drafter hot swap is not configured (no redis_url / mlflow_tracking_uri)",
                       409, code="swap_not_configured")
    return swapper


async def _call(fn, *args, **kwargs):
    from serving.swap_errors import SwapError

    try:
        return await asyncio.to_thread(fn, *args, **kwargs)
    except SwapError as e:
        raise APIError(str(e), e.status, code=type(e).__name__) from e


@admin_router.get("/drafter")
async def drafter_info(raw: Request) -> dict:
    drafter = raw.app.state.openai_serving.engine.drafter
    info = {"kind": getattr(drafter, "kind", None), "version": getattr(drafter, "version", None)}
    swapper = getattr(raw.app.state, "swapper", None)
    if swapper is not None:
        info.update(swapper.status())
    return info


@admin_router.post("/drafter/swap")
async def drafter_swap(body: SwapBody, raw: Request) -> dict:
    return await _call(_swapper(raw).swap_to, body.version, reason="admin")


class RollbackBody(BaseModel):
    model_config = ConfigDict(coerce_numbers_to_str=True)

    from_version: str | None = None
    """Roll back only while this version is live (None: whatever is live)."""


@admin_router.post("/drafter/rollback")
async def drafter_rollback(raw: Request, body: RollbackBody | None = None) -> dict:
    expected = body.from_version if body is not None else None
    return await _call(_swapper(raw).rollback, reason="admin", from_version=expected)


def _control(raw: Request):
    return getattr(getattr(raw.app.state, "swapper", None), "control", None)


def _indexed(raw: Request) -> set[str]:
    return set(getattr(raw.app.state.openai_serving.engine.drafter, "indexed_tenants", list)())


def _deleted_here(raw: Request) -> set[str]:
    """Tenants whose index a DELETE dropped here: a retry of it (after a 503) still names them."""
    if not hasattr(raw.app.state, "tenants_deleted"):
        raw.app.state.tenants_deleted = set()
    return raw.app.state.tenants_deleted


def _known_tenants(raw: Request) -> set[str]:
    """Tenants this server can name: its API keys', the one it follows, those with an index here
    and those a DELETE here dropped."""
    settings = raw.app.state.openai_serving.settings
    return set(settings.api_keys.values()) | {settings.tenant} | _indexed(raw) | _deleted_here(raw)


@admin_router.get("/tenants/{tenant}")
async def tenant_info(tenant: str, raw: Request) -> dict:
    """Whether this server knows ``tenant`` and whether a deletion of its data is still pending
    (the trainer that follows it removes the request once replay and checkpoints are rewritten)."""
    control = _control(raw)
    info = {"tenant": tenant, "known": tenant in _known_tenants(raw),
            "suffix_index": tenant in _indexed(raw)}
    if control is None:
        return info | {"deletion_pending": None, "deletion_requested_at": None}
    at, up = await asyncio.to_thread(lambda: (control.deletion_requested_at(tenant), control.ping()))
    if not up:
        raise unavailable("the control plane (Redis) is unavailable: a deletion's state is not known",
                          1.0, code="control_plane_unavailable")
    return info | {"deletion_pending": at is not None, "deletion_requested_at": at}


@admin_router.delete("/tenants/{tenant}")
async def delete_tenant(tenant: str, raw: Request, force: bool = False) -> dict:
    """Delete a tenant's data: its suffix index here, and (through the control plane) its traces
    in the trainer's replay and checkpoints, which the tenant's trainer drops at its next round
    (``GET /admin/tenants/{tenant}`` says when it is done). Trace messages already on the Kafka
    topic age out with the topic's retention.

    A tenant this server cannot name (not an API key's, not the one it follows, no index here) is a
    404: a typo would file a request no trainer ever completes. ``?force=true`` files it anyway
    (a tenant served before a restart whose index was not rebuilt, or one evicted from the
    indexes)."""
    drafter = raw.app.state.openai_serving.engine.drafter
    control = _control(raw)
    pending = control is not None and await asyncio.to_thread(control.deletion_requested_at, tenant)
    if not force and tenant not in _known_tenants(raw) and not pending:
        raise APIError(f"unknown tenant {tenant!r}: no API key maps to it, this server does not "
                       f"follow it and has no index of it; add ?force=true to file the deletion "
                       f"anyway", 404, code="unknown_tenant")
    forget = getattr(drafter, "forget_tenant", None)  # at once: its continuations are drafted no more
    index_dropped = bool(forget(tenant)) if forget is not None else False
    _deleted_here(raw).add(tenant)
    requested = False  # no control plane configured: nothing to ask (the 200 says so)
    if control is not None:
        requested = bool(await asyncio.to_thread(control.request_deletion, tenant))
        if not requested:  # Redis down (or the plane backing off): the trainer keeps the data
            retry_s = getattr(getattr(control, "settings", None), "retry_after_s", None)
            raise unavailable(
                f"The trainer was not reached (control plane unavailable): deletion of tenant "
                f"{tenant!r}'s traces in replay and checkpoints was not requested. Retry the "
                f"request; it is safe to repeat (dropping this replica's suffix index again is "
                f"harmless).",
                retry_s if isinstance(retry_s, (int, float)) else 1.0, code="trainer_unreachable")
    return {"tenant": tenant, "suffix_index_dropped": index_dropped,
            "trainer_deletion_requested": requested}
