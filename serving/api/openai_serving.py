"""Turns validated OpenAI requests into engine requests and engine chunks into OpenAI responses.

The router stays a list of routes; this module owns the checks that depend on the deployment
(model name, max_tokens limit, context length), tokenisation, the SSE stream, and aborting the
engine request when the client goes away.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from functools import partial

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from serving.api import protocol as p
from serving.api.errors import APIError, bad_request, model_not_found, overloaded, unavailable
from serving.api.tenants import resolve_tenant
from serving.config import ServingSettings
from serving.engine.base import (
    Engine,
    GenerationChunk,
    GenerationRequest,
    Overloaded,
    RequestError,
    SamplingParams,
    Unavailable,
)

log = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

# The sampler computes in float32: a temperature or top_p below its range arrives as 0 (an error
# that fails the whole batch) or as a denormal (garbage tokens). Near 0 both mean greedy: below
# GREEDY_TEMPERATURE sampling is greedy (vLLM's rule), and any top_p under 1/vocab keeps the most
# likely token alone, as MIN_TOP_P does for vocabularies under a million.
GREEDY_TEMPERATURE = 1e-5
MIN_TOP_P = 1e-6


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class OpenAIServing:
    def __init__(self, engine: Engine, settings: ServingSettings):
        self.engine = engine
        self.settings = settings
        self.served_model_name = settings.served_model_name or engine.model_name

    # ------------------------------------------------------------------ checks and encoding

    def check_model(self, model: str | None) -> str:
        if model in (None, "", self.served_model_name, self.engine.model_name):
            return self.served_model_name
        raise model_not_found(model)

    def models(self) -> p.ModelList:
        card = p.ModelCard(
            id=self.served_model_name,
            root=self.engine.model_name,
            max_model_len=self.engine.max_context,
        )
        return p.ModelList(data=[card])

    def tenant_of(self, req, raw: Request) -> str:
        return resolve_tenant(self.settings.api_keys, raw.headers.get("authorization"), req.tenant)

    def _tokenizer(self):
        tok = self.engine.tokenizer
        if tok is None:
            raise bad_request("this model has no tokenizer: send the prompt as token ids", "prompt")
        return tok

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = list(self._tokenizer().encode(prompt))
        else:
            vocab = self.engine.fingerprint.vocab_size
            bad = next((t for t in prompt if not 0 <= t < vocab), None)
            if bad is not None:
                raise bad_request(
                    f"prompt token id {bad} is outside the vocabulary [0, {vocab})", "prompt"
                )
            ids = list(prompt)
        if not ids:
            raise bad_request("prompt must not be empty", "prompt")
        return ids

    def encode_chat(self, messages: list[p.ChatMessage]) -> list[int]:
        tok = self._tokenizer()
        if not getattr(tok, "chat_template", None):
            raise bad_request("this model has no chat template: use /v1/completions", "messages")
        conversation = [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in messages
        ]
        try:
            text = tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # jinja raises TemplateError for e.g. non-alternating roles
            raise bad_request(f"messages do not fit the chat template: {exc}", "messages") from exc
        return list(tok.encode(text, add_special_tokens=False))

    def max_tokens(
        self, requested: int | None, prompt_len: int, prompt_param: str, name: str = "max_tokens"
    ) -> int:
        """Validate ``max_tokens`` against the server limit and the context left after the prompt.
        Unset, it defaults to the server default, shortened to fit the context. ``name``: the
        field the client sent (chat's ``max_completion_tokens``), for the error messages."""
        ctx, limit = self.engine.max_context, self.settings.max_tokens_limit
        if requested is not None and requested > limit:
            raise bad_request(f"{name}={requested} exceeds this server's limit of {limit}", name)
        if prompt_len >= ctx:
            raise bad_request(
                f"This model's maximum context length is {ctx} tokens, and the prompt has "
                f"{prompt_len} tokens, leaving none to generate. Shorten the prompt.",
                prompt_param,
                "context_length_exceeded",
            )
        if requested is None:
            default = self.settings.default_max_tokens
            return min(limit if default is None else default, ctx - prompt_len)
        if prompt_len + requested > ctx:
            raise bad_request(
                f"This model's maximum context length is {ctx} tokens, but the request asks for "
                f"{prompt_len + requested} ({prompt_len} prompt tokens + {name}={requested}). "
                f"Shorten the prompt or lower {name}.",
                name,
                "context_length_exceeded",
            )
        return requested

    def engine_request(
        self,
        req: p.CompletionRequest | p.ChatCompletionRequest,
        prompt_ids: list[int],
        prompt_param: str,
        request_id: str,
        tenant: str | None = None,
    ) -> GenerationRequest:
        """``tenant``: who the request is (``resolve_tenant``); None = the body's, as given."""
        temperature = self.settings.default_temperature if req.temperature is None else req.temperature
        top_k = req.top_k or 0
        fingerprint = getattr(self.engine, "fingerprint", None)  # SGLang's: None until it knows
        vocab = fingerprint.vocab_size if fingerprint is not None else 2**31
        if top_k < 0 or top_k >= vocab:
            top_k = 0  # no cut (a value past int64 would fail the engine step)
        sent = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) else "max_tokens"
        params = SamplingParams(
            temperature=0.0 if temperature < GREEDY_TEMPERATURE else temperature,
            top_p=1.0 if req.top_p is None else max(req.top_p, MIN_TOP_P),
            top_k=top_k,
            max_tokens=self.max_tokens(req.max_tokens, len(prompt_ids), prompt_param, sent),
            stop=req.stop,
            seed=req.seed,
            ignore_eos=req.ignore_eos,
        )
        return GenerationRequest(
            request_id=request_id,
            prompt_ids=prompt_ids,
            params=params,
            tenant=tenant or req.tenant or "default",
            domain=req.domain,
            train=req.train,
        )

    # ------------------------------------------------------------------ endpoints

    async def completion(self, req: p.CompletionRequest, raw: Request) -> Response:
        model = self.check_model(req.model)
        rid = f"cmpl-{uuid.uuid4().hex}"
        tenant = self.tenant_of(req, raw)
        greq = self.engine_request(req, self.encode_prompt(req.prompt), "prompt", rid, tenant)
        # one id and one ``created`` for the response or every chunk of its stream
        response = partial(p.CompletionResponse, id=rid, created=p.now_s(), model=model)

        def chunk(text: str, finish: str | None) -> dict:
            choice = p.CompletionChoice(text=text, finish_reason=finish)
            return response(choices=[choice]).model_dump()

        def usage_chunk(usage: p.Usage) -> dict:
            return response(choices=[], usage=usage).model_dump()

        if req.stream:
            opened = await self._open(greq, raw)
            events = self._stream(opened, greq, chunk, usage_chunk, None, _include_usage(req))
            return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
        text, last = await self._collect(greq, raw)
        choice = p.CompletionChoice(text=text, finish_reason=last.finish_reason)
        return _json(response(choices=[choice], usage=_usage(last, greq)))

    async def chat(self, req: p.ChatCompletionRequest, raw: Request) -> Response:
        model = self.check_model(req.model)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", p.now_s()
        tenant = self.tenant_of(req, raw)
        greq = self.engine_request(req, self.encode_chat(req.messages), "messages", rid, tenant)
        stream_chunk = partial(p.ChatCompletionChunk, id=rid, created=created, model=model)

        def chunk(text: str | None, finish: str | None, role: str | None = None) -> dict:
            delta = p.DeltaMessage(role=role, content=text)
            choice = p.ChatChunkChoice(delta=delta, finish_reason=finish)
            return stream_chunk(choices=[choice]).model_dump()

        def usage_chunk(usage: p.Usage) -> dict:
            return stream_chunk(choices=[], usage=usage).model_dump()

        if req.stream:
            first = chunk("", None, role="assistant")
            opened = await self._open(greq, raw)
            events = self._stream(opened, greq, chunk, usage_chunk, first, _include_usage(req))
            return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
        text, last = await self._collect(greq, raw)
        choice = p.ChatChoice(
            message=p.AssistantMessage(content=text), finish_reason=last.finish_reason
        )
        return _json(
            p.ChatCompletionResponse(
                id=rid, created=created, model=model, choices=[choice], usage=_usage(last, greq)
            )
        )

    # ------------------------------------------------------------------ engine plumbing

    async def generate(self, greq: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """``engine.generate`` that aborts the engine request if the consumer stops early
        (client disconnect cancels the streaming task; a failed write closes the generator)."""
        finished = False
        chunks = self.engine.generate(greq)
        try:
            async for c in chunks:
                finished = c.finished
                if finished and c.finish_reason == "abort":
                    # The engine stopped under it (shutdown; SGLang ended it without a reason):
                    # "abort" is no OpenAI finish_reason, and a 200 would pass truncated text off
                    # as an answer. A 503 (in-band once a stream has started) says to retry.
                    raise Unavailable("the engine stopped before finishing this request")
                yield c
                if finished:
                    return
        finally:
            if not finished:
                with anyio.CancelScope(shield=True):  # we may be running inside a cancelled scope
                    log.info("aborting %s (client gone or stream closed)", greq.request_id)
                    await self.engine.abort(greq.request_id)
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()

    async def _collect(self, greq: GenerationRequest, raw: Request) -> tuple[str, GenerationChunk]:
        """Run a request to the end; abort it if the client disconnects first."""

        async def run() -> tuple[str, GenerationChunk]:
            parts, last = [], None
            async for c in self.generate(greq):
                parts.append(c.text)
                last = c
            if last is None:
                raise APIError("the engine returned no output", 500, "server_error")
            return "".join(parts), last

        task = await _unless_disconnected(run(), raw)  # cancelled: generate's finally aborted it
        if task.cancelled():
            raise ClientDisconnected()
        try:
            return task.result()
        except RequestError as exc:
            raise _api_error(exc) from exc

    async def _open(self, greq: GenerationRequest, raw: Request) -> tuple[AsyncIterator[GenerationChunk], list]:
        """Start a streamed request and wait for its first chunk, so that a refusal (429 when
        overloaded, 400 for a bad request) is a real HTTP status, not an error inside a 200 stream.
        Returns the open generator and the chunk(s) already read. A client that leaves while the
        request waits for a row (a full engine) aborts it there, before it is prefilled."""
        chunks = self.generate(greq)
        first = await _unless_disconnected(anext(chunks), raw)
        try:
            if first.cancelled():
                raise ClientDisconnected()
            return chunks, [first.result()]
        except StopAsyncIteration:
            return chunks, []
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                await chunks.aclose()
            if isinstance(exc, Exception):
                raise _api_error(exc) from exc
            raise

    async def _stream(
        self,
        opened: tuple[AsyncIterator[GenerationChunk], list],
        greq: GenerationRequest,
        chunk: Callable,
        usage_chunk: Callable,
        first: dict | None,
        include_usage: bool,
    ) -> AsyncIterator[str]:
        if first is not None:
            yield sse(first)
        last = None
        # aclosing: if this stream is closed while parked at a yield, the engine request is
        # aborted now rather than whenever the garbage collector finalises the generator.
        chunks, read = opened
        async with aclosing(chunks):
            try:
                async for c in _chain(read, chunks):
                    last = c
                    if c.text or c.finished:
                        yield sse(chunk(c.text, c.finish_reason if c.finished else None))
            except Exception as exc:  # the status line is sent: report in-band, end the stream
                err = _api_error(exc)
                if err.status >= 500:
                    log.error("stream %s failed: %s", greq.request_id, exc, exc_info=exc)
                yield sse(err.body())
            else:
                if include_usage and last is not None:
                    yield sse(usage_chunk(_usage(last, greq)))
        yield sse("[DONE]")


class ClientDisconnected(APIError):
    """The client went away before a non-streamed response was ready (nobody reads the answer)."""

    def __init__(self):
        super().__init__("client disconnected", 499, "client_closed_request")


async def _wait_for_disconnect(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(work, raw: Request) -> asyncio.Task:
    """``work`` run as a task until it is done or the client disconnects, whichever comes first;
    in the second case the task is cancelled (and awaited) before this returns it."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(raw))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(task, return_exceptions=True)
    return task


def _api_error(exc: Exception) -> APIError:
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


async def _chain(read: list, rest: AsyncIterator) -> AsyncIterator:
    for c in read:
        yield c
    async for c in rest:
        yield c


def _include_usage(req) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


def _usage(last: GenerationChunk, greq: GenerationRequest) -> p.Usage:
    prompt = last.prompt_tokens or len(greq.prompt_ids)
    return p.Usage(
        prompt_tokens=prompt,
        completion_tokens=last.completion_tokens,
        total_tokens=prompt + last.completion_tokens,
        spec=p.SpecUsage.of(last.stats),
    )


def _json(model) -> JSONResponse:
    return JSONResponse(model.model_dump())
