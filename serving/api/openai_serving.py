"""Turns validated OpenAI requests into engine requests and engine chunks into OpenAI responses.

The router stays a list of routes; this module owns the checks that depend on the deployment
(model name, max_tokens limit, context length), tokenisation (on a worker thread: a long prompt
takes a while, and the event loop serves every stream), the SSE stream, and aborting the engine
request when the client goes away.
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
from serving.api import responses as r
from serving.api.disconnect import ClientDisconnected, unless_disconnected
from serving.api.errors import APIError, bad_request, engine_error, model_not_found
from serving.api.tenants import resolve_tenant
from serving.config import ServingSettings
from serving.engine.base import (
    Engine,
    GenerationChunk,
    GenerationRequest,
    RequestError,
    SamplingParams,
    Unavailable,
)
from serving.engine.request_checks import outside_vocab
from serving.output import max_token_chars

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
        self._token_chars: tuple[object, int | None] = (None, None)  # (tokenizer, its bound)

    # ------------------------------------------------------------------ checks and encoding

    def check_model(self, model: str | None) -> str:
        if model in (None, "", self.served_model_name, self.engine.model_name):
            return self.served_model_name
        raise model_not_found(model)

    def models(self) -> r.ModelList:
        card = r.ModelCard(
            id=self.served_model_name,
            root=self.engine.model_name,
            max_model_len=self.engine.max_context,
        )
        return r.ModelList(data=[card])

    def tenant_of(self, req, raw: Request) -> str:
        return resolve_tenant(self.settings.api_keys, raw.headers.get("authorization"), req.tenant)

    def _tokenizer(self):
        tok = self.engine.tokenizer
        if tok is None:
            raise bad_request("this model has no tokenizer: send the prompt as token ids", "prompt")
        return tok

    def _refuse_if_too_long(self, chars: int, param: str) -> None:
        """400 context_length_exceeded for a text of ``chars`` characters that has more tokens
        than the context holds whatever they are (``max_token_chars``), before tokenising it."""
        ctx = getattr(self.engine, "max_context", None)  # SGLang's: 0 until it knows
        if not ctx or chars < ctx:  # fewer characters than the context has tokens: may fit
            return
        tok = self.engine.tokenizer
        if self._token_chars[0] is not tok:  # once per tokenizer (~0.1 s for 49k tokens)
            self._token_chars = (tok, max_token_chars(tok))
        per_token = self._token_chars[1]
        least = -(-chars // per_token) if per_token else 0
        if least >= ctx:
            raise bad_request(
                f"This model's maximum context length is {ctx} tokens, and the prompt has at least "
                f"{least} tokens ({chars} characters), leaving none to generate. Shorten the prompt.",
                param,
                "context_length_exceeded",
            )

    def _vocab_size(self) -> int | None:
        fingerprint = getattr(self.engine, "fingerprint", None)  # SGLang's: None until it knows
        return fingerprint.vocab_size if fingerprint is not None else None

    def _in_vocab(self, ids: list[int], param: str) -> list[int]:
        """``ids``, or a 400 naming ``param`` and the first id outside the vocabulary (not known
        yet, as SGLang's until it loads: only a negative one)."""
        if why := outside_vocab(ids, param, self._vocab_size()):
            raise bad_request(why, param)
        return list(ids)

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        """The prompt's token ids (blocking: the endpoints call it on a worker thread)."""
        if isinstance(prompt, str):
            tok = self._tokenizer()
            self._refuse_if_too_long(len(prompt), "prompt")
            ids = list(tok.encode(prompt))
        else:
            ids = self._in_vocab(prompt, "prompt")
        if not ids:
            raise bad_request("prompt must not be empty", "prompt")
        return ids

    def encode_chat(self, messages: list[p.ChatMessage]) -> list[int]:
        """The chat template's token ids (blocking: the endpoints call it on a worker thread)."""
        tok = self._tokenizer()
        if not getattr(tok, "chat_template", None):
            raise bad_request("this model has no chat template: use /v1/completions", "messages")
        # The template holds every message as given (or trimmed); an assistant's may be cut (some
        # templates drop a past answer's reasoning), so only the others count.
        self._refuse_if_too_long(
            sum(len(m.text().strip()) for m in messages if m.role != "assistant"), "messages"
        )
        conversation = [m.for_template() for m in messages]
        try:
            text = tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # jinja raises TemplateError for e.g. non-alternating roles
            raise bad_request(f"messages do not fit the chat template: {exc}", "messages") from exc
        return list(tok.encode(text, add_special_tokens=False))

    def max_tokens(
        self, requested: int | None, prompt_len: int, prompt_param: str, name: str = "max_tokens",
        default: int | None = None,
    ) -> int:
        """Validate ``max_tokens`` against the server limit and the context left after the prompt.
        Unset, it is the server's default_max_tokens, else ``default`` (None: the limit),
        shortened to fit the context. ``name``: the field the client sent (chat's
        ``max_completion_tokens``), for the error messages."""
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
            return min(self.settings.default_max_tokens or default or limit, limit, ctx - prompt_len)
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
        vocab = self._vocab_size() or 2**31
        if top_k < 0 or top_k >= vocab:
            top_k = 0  # no cut (a value past int64 would fail the engine step)
        sent = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) else "max_tokens"
        default = p.COMPLETION_DEFAULT_MAX_TOKENS if isinstance(req, p.CompletionRequest) else None
        params = SamplingParams(
            temperature=0.0 if temperature < GREEDY_TEMPERATURE else temperature,
            top_p=1.0 if req.top_p is None else max(req.top_p, MIN_TOP_P),
            top_k=top_k,
            max_tokens=self.max_tokens(req.max_tokens, len(prompt_ids), prompt_param, sent, default),
            stop=req.stop,
            stop_token_ids=self._in_vocab(req.stop_token_ids, "stop_token_ids"),
            seed=req.seed,
            ignore_eos=req.ignore_eos,
            skip_special_tokens=req.skip_special_tokens,
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
        ids = await asyncio.to_thread(self.encode_prompt, req.prompt)
        greq = self.engine_request(req, ids, "prompt", rid, tenant)
        # one id and one ``created`` for the response or every chunk of its stream
        response = partial(r.CompletionResponse, id=rid, created=r.now_s(), model=model)

        def chunk(text: str, finish: str | None) -> dict:
            choice = r.CompletionChoice(text=text, finish_reason=finish)
            return response(choices=[choice]).model_dump()

        def usage_chunk(usage: r.Usage) -> dict:
            return response(choices=[], usage=usage).model_dump()

        if req.stream:
            opened = await self._open(greq, raw)
            events = self._stream(opened, greq, chunk, usage_chunk, None, _include_usage(req))
            return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
        text, last = await self._collect(greq, raw)
        choice = r.CompletionChoice(text=text, finish_reason=last.finish_reason)
        return _json(response(choices=[choice], usage=_usage(last, greq)))

    async def chat(self, req: p.ChatCompletionRequest, raw: Request) -> Response:
        model = self.check_model(req.model)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", r.now_s()
        tenant = self.tenant_of(req, raw)
        ids = await asyncio.to_thread(self.encode_chat, req.messages)
        greq = self.engine_request(req, ids, "messages", rid, tenant)
        stream_chunk = partial(r.ChatCompletionChunk, id=rid, created=created, model=model)

        def chunk(text: str | None, finish: str | None, role: str | None = None) -> dict:
            delta = r.DeltaMessage(role=role, content=text)
            choice = r.ChatChunkChoice(delta=delta, finish_reason=finish)
            return stream_chunk(choices=[choice]).model_dump()

        def usage_chunk(usage: r.Usage) -> dict:
            return stream_chunk(choices=[], usage=usage).model_dump()

        if req.stream:
            first = chunk("", None, role="assistant")
            opened = await self._open(greq, raw)
            events = self._stream(opened, greq, chunk, usage_chunk, first, _include_usage(req))
            return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
        text, last = await self._collect(greq, raw)
        choice = r.ChatChoice(
            message=r.AssistantMessage(content=text), finish_reason=last.finish_reason
        )
        return _json(
            r.ChatCompletionResponse(
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

        task = await unless_disconnected(run(), raw)  # cancelled: generate's finally aborted it
        if task.cancelled():
            raise ClientDisconnected()
        try:
            return task.result()
        except RequestError as exc:
            raise engine_error(exc) from exc

    async def _open(self, greq: GenerationRequest, raw: Request) -> tuple[AsyncIterator[GenerationChunk], list]:
        """Start a streamed request and wait for its first chunk, so that a refusal (429 when
        overloaded, 400 for a bad request) is a real HTTP status, not an error inside a 200 stream.
        Returns the open generator and the chunk(s) already read. A client that leaves while the
        request waits for a row (a full engine) aborts it there, before it is prefilled."""
        chunks = self.generate(greq)
        first = await unless_disconnected(anext(chunks), raw)
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
                raise engine_error(exc) from exc
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
                err = engine_error(exc)
                if err.status >= 500:
                    log.error("stream %s failed: %s", greq.request_id, exc, exc_info=exc)
                yield sse(err.body())
            else:
                if include_usage and last is not None:
                    yield sse(usage_chunk(_usage(last, greq)))
        yield sse("[DONE]")


async def _chain(read: list, rest: AsyncIterator) -> AsyncIterator:
    for c in read:
        yield c
    async for c in rest:
        yield c


def _include_usage(req) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


def _usage(last: GenerationChunk, greq: GenerationRequest) -> r.Usage:
    prompt = last.prompt_tokens or len(greq.prompt_ids)
    return r.Usage(
        prompt_tokens=prompt,
        completion_tokens=last.completion_tokens,
        total_tokens=prompt + last.completion_tokens,
        spec=r.SpecUsage.of(last.stats),
    )


def _json(model) -> JSONResponse:
    return JSONResponse(model.model_dump())
