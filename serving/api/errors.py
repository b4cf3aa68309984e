"""OpenAI-shaped errors: every non-2xx body is ``{"error": {"message", "type", "param", "code"}}``.

Bad input is a 400 (as OpenAI and vLLM answer it, so the official client raises BadRequestError),
including request-validation failures that FastAPI would answer with a 422.
"""

from __future__ import annotations

import logging
import math
import re
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving.engine.base import Overloaded, RequestError, Unavailable

log = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(
        self,
        message: str,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.headers = headers
        self.message, self.status, self.type, self.param, self.code = (
            message,
            status,
            type,
            param,
            code,
        )

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(message, 400, param=param, code=code)


def _retry_after(seconds: float) -> dict:
    """The Retry-After header: whole seconds, at least 1."""
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


def overloaded(message: str, retry_after_s: float) -> APIError:
    """429 in OpenAI's shape (``type: requests``, ``code: rate_limit_exceeded``) with Retry-After."""
    return APIError(message, 429, "requests", code="rate_limit_exceeded",
                    headers=_retry_after(retry_after_s))


def unavailable(message: str, retry_after_s: float, code: str = "engine_unavailable") -> APIError:
    """503 with Retry-After: the engine is stopping or not running (or, by ``code``, another part
    the request needs is unreachable); the request was not (fully) served: retry."""
    return APIError(message, 503, "server_error", code=code, headers=_retry_after(retry_after_s))


def model_not_found(model: str) -> APIError:
    return APIError(
        f"The model {model!r} does not exist", 404, param="model", code="model_not_found"
    )


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _json(status: int, body: dict, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(body, status_code=status, headers=headers)


# Union members show up in error locations as type tags (``prompt.list[int].0``); they add noise.
_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|[a-z-]+\[.*\]|[A-Z]\w*)$")


def validation_message(
    exc: RequestValidationError, content_type: str | None = None
) -> tuple[str, str | None]:
    """A readable message, e.g. ``temperature: Input should be less than or equal to 2``, and the
    param of the first problem. ``content_type``: the request's; a body sent without a JSON one
    (``curl -d`` sends form encoding) is never parsed, whatever it holds, so the message says so."""
    by_loc: dict[str, list[str]] = {}
    for err in exc.errors():
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        if not loc and "field" in (err.get("ctx") or {}):  # a whole-body check names its field
            loc = [str(err["ctx"]["field"])]
        kind = err.get("type", "")
        if kind == "json_invalid":
            detail = (err.get("ctx") or {}).get("error", "malformed JSON")
            at = f" (at character {loc[0]})" if loc else ""
            return f"Invalid JSON in request body: {detail}{at}", None
        if not loc and kind in ("model_attributes_type", "dict_type"):
            if "json" not in (content_type or "").lower():
                return (f"Request body must be a JSON object sent with Content-Type: "
                        f"application/json (got {content_type or 'no Content-Type'})"), None
            return "Request body must be a JSON object", None
        if not loc and kind == "missing":
            return "Request body is missing (send a JSON object)", None
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        where = ".".join(p for p in loc if not _TYPE_TAG.match(p))
        msgs = by_loc.setdefault(where, [])
        if msg not in msgs:
            msgs.append(msg)
    parts = [
        f"{where}: {' or '.join(msgs)}" if where else " or ".join(msgs)
        for where, msgs in by_loc.items()
    ]
    first = next(iter(by_loc), "")
    return "; ".join(parts) or "Invalid request", (first.split(".")[0] or None)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return _json(exc.status, exc.body(), exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        message, param = validation_message(exc, request.headers.get("content-type"))
        return _json(400, error_body(message, "invalid_request_error", param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
        # OpenAI's type for an unknown route (404) and a wrong method (405) alike
        return _json(exc.status_code, error_body(message, "invalid_request_error"), getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception):
        log.exception("unhandled error")
        return _json(
            500, error_body(f"Internal server error: {type(exc).__name__}", "server_error")
        )


def engine_error(exc: Exception) -> APIError:
    """What the client is told of an exception from the engine (overload, unavailability, a bad
    request found there), or a 500 that names only its type."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, Overloaded):
        return overloaded(str(exc), exc.retry_after_s)
    if isinstance(exc, Unavailable):
        return unavailable(str(exc), exc.retry_after_s)
    if isinstance(exc, RequestError):
        if exc.invalid:
            return bad_request(str(exc))
        return APIError(str(exc), 500, "server_error")
    return APIError(f"Internal server error: {type(exc).__name__}", 500, "server_error")
