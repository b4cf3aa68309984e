"""The OpenAI-compatible API, end to end: the official ``openai`` client against a live uvicorn
server on a loopback port, serving a TorchEngine (suffix drafter) over a tiny random Llama with the
real SmolLM2 tokenizer. One server per module."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import socket
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace

import httpx
import openai
import pytest
import uvicorn
from prometheus_client import CollectorRegistry

from feedback.bus.sink import InProcessTraceSink
from serving.api import protocol, responses
from serving.api.app import create_app
from serving.builder import build_engine
from serving.config import ServingSettings
from serving.engine.config import EngineConfig
from serving.engine.reference import target_greedy_reference
from serving.engine.torch_engine import TorchEngine
from serving.target import Target, tiny_target

SERVED = "tiny-smol"
ADMIN_TOKEN = "test-admin-token"
LIMIT = 1500  # max_tokens limit; the tiny model's context is 2048


@dataclass
class Live:
    base_url: str
    client: openai.OpenAI
    http: httpx.Client
    target: Target
    engine: object
    sink: InProcessTraceSink
    registry: CollectorRegistry

    def metric(self, name: str, labels: dict | None = None) -> float:
        return self.registry.get_sample_value(name, labels or {}) or 0.0


def _wait_for(predicate, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"gave up waiting for {what}")


@pytest.fixture(scope="module")
def live():
    target = tiny_target()
    settings = ServingSettings(
        served_model_name=SERVED,
        drafter="suffix",
        k=4,
        max_batch_size=4,
        default_max_tokens=16,
        default_temperature=0.0,  # greedy unless asked: outputs compare with the target's own
        max_tokens_limit=LIMIT,
        admin_token=ADMIN_TOKEN,
    )
    registry, sink = CollectorRegistry(), InProcessTraceSink()
    engine = build_engine(settings, target=target, registry=registry, sink=sink)
    app = create_app(engine, settings, registry)

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    _wait_for(lambda: server.started or not thread.is_alive(), "the server to start")
    assert server.started, "uvicorn did not start"

    base = f"http://127.0.0.1:{port}"
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
    with httpx.Client(base_url=base, timeout=120) as http:
        yield Live(base, client, http, target, engine, sink, registry)
    server.should_exit = True
    thread.join(timeout=60)
    assert not thread.is_alive(), "uvicorn did not shut down"


def _reference_text(live: Live, prompt_ids: list[int], n: int) -> str:
    ids = target_greedy_reference(live.target.model, prompt_ids, n)
    return live.target.tokenizer.decode(ids, skip_special_tokens=True)


def _chat_ids(live: Live, messages: list[dict]) -> list[int]:
    tok = live.target.tokenizer
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


def _assert_spec(usage) -> dict:
    spec = usage.model_extra["spec"]
    assert set(spec) == {
        "verify_steps",
        "drafted_tokens",
        "accepted_tokens",
        "mean_accept_len",
        "acceptance_rate",
    }
    steps, drafted, accepted = spec["verify_steps"], spec["drafted_tokens"], spec["accepted_tokens"]
    assert steps >= 1 and 0 <= accepted <= drafted
    # every output token comes out of a verify step (accepted drafts + one token per step)
    assert usage.completion_tokens <= accepted + steps
    assert spec["mean_accept_len"] == pytest.approx((accepted + steps) / steps, abs=1e-3)
    assert spec["acceptance_rate"] == pytest.approx(
        accepted / drafted if drafted else 0.0, abs=1e-3
    )
    return spec


# ---------------------------------------------------------------------------- happy paths


def test_completion_is_target_greedy_with_usage(live):
    prompt = "The quick brown fox jumps over the lazy dog. The quick brown fox"
    out = live.client.completions.create(
        model=SERVED, prompt=prompt, max_tokens=24, extra_body={"ignore_eos": True}
    )
    prompt_ids = live.target.tokenizer.encode(prompt)
    assert out.object == "text_completion" and out.model == SERVED
    assert out.choices[0].text == _reference_text(live, prompt_ids, 24)
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(prompt_ids)
    assert out.usage.completion_tokens == 24
    assert out.usage.total_tokens == len(prompt_ids) + 24
    _assert_spec(out.usage)


def test_completion_accepts_token_ids_and_default_model(live):
    ids = live.target.tokenizer.encode("Hello there, general")
    out = live.client.completions.create(
        model="", prompt=ids, max_tokens=8, extra_body={"ignore_eos": True}
    )
    assert out.choices[0].text == _reference_text(live, ids, 8)
    assert out.usage.prompt_tokens == len(ids)


def test_streamed_completion_concatenates_to_the_full_text(live):
    kwargs = {
        "model": SERVED,
        "prompt": "Once upon a time",
        "max_tokens": 20,
        "extra_body": {"ignore_eos": True},
    }
    full = live.client.completions.create(**kwargs).choices[0].text
    chunks = list(
        live.client.completions.create(
            stream=True, stream_options={"include_usage": True}, **kwargs
        )
    )
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(c.choices[0].text for c in text_chunks) == full
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 20
    _assert_spec(usage_chunk.usage)
    assert len({c.id for c in chunks}) == 1


def test_chat_uses_the_chat_template(live):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a colour."},
    ]
    out = live.client.chat.completions.create(
        model=SERVED, messages=messages, max_completion_tokens=12, extra_body={"ignore_eos": True}
    )
    ids = _chat_ids(live, messages)
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == _reference_text(live, ids, 12)
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 12
    _assert_spec(out.usage)


def test_streamed_chat_matches_non_streamed(live):
    kwargs = {
        "model": SERVED,
        "messages": [{"role": "user", "content": "Count to five."}],
        "max_tokens": 16,
        "extra_body": {"ignore_eos": True},
    }
    full = live.client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(live.client.chat.completions.create(stream=True, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_stop_string_ends_the_text_before_it(live):
    kwargs = {
        "model": SERVED,
        "prompt": "Lists: one, two,",
        "max_tokens": 24,
        "extra_body": {"ignore_eos": True},
    }
    full = live.client.completions.create(**kwargs).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop.strip(), f"degenerate greedy text {full!r}"
    out = live.client.completions.create(stop=[stop], **kwargs).choices[0]
    assert out.text == full[: full.index(stop)]
    assert out.finish_reason == "stop"


def test_concurrent_requests_are_each_answered_exactly(live):
    prompts = [f"Request number {i} says" for i in range(4)]
    results: dict[int, str] = {}

    def ask(i):
        results[i] = (
            live.client.completions.create(
                model=SERVED, prompt=prompts[i], max_tokens=12, extra_body={"ignore_eos": True}
            )
            .choices[0]
            .text
        )

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tok = live.target.tokenizer
    assert results == {i: _reference_text(live, tok.encode(p), 12) for i, p in enumerate(prompts)}


def test_train_false_emits_no_trace_and_tenant_reaches_the_trace(live):
    live.sink.drain()
    skipped = live.client.completions.create(
        model=SERVED, prompt="private", max_tokens=4, extra_body={"train": False}
    )
    kept = live.client.completions.create(
        model=SERVED, prompt="public", max_tokens=4, extra_body={"tenant": "acme", "domain": "code"}
    )
    seen = []

    def kept_arrived():
        seen.extend(live.sink.drain(timeout=0.1))
        return any(r.request_id == kept.id for r in seen)

    _wait_for(kept_arrived, "the trace of the train=true request")
    assert skipped.id not in {r.request_id for r in seen}
    record = next(r for r in seen if r.request_id == kept.id)
    assert (record.tenant, record.domain) == ("acme", "code")


def test_models_health_and_metrics(live):
    models = live.client.models.list()
    assert [m.id for m in models.data] == [SERVED]
    assert live.client.models.retrieve(SERVED).id == SERVED

    health = live.http.get("/health")
    assert health.status_code == 200
    assert health.json()["status"] == "ok" and health.json()["drafter"]["kind"] == "suffix"

    live.client.completions.create(model=SERVED, prompt="metrics please", max_tokens=4)
    body = live.http.get("/metrics").text
    for series in (
        "specloop_spec_drafted_tokens_total",
        "specloop_spec_accepted_tokens_total",
        "specloop_spec_verify_steps_total",
        "specloop_spec_accept_length_bucket",
        "specloop_drafter_info",
    ):
        assert series in body, series
    steps = next(
        line for line in body.splitlines() if line.startswith("specloop_spec_verify_steps_total")
    )
    assert float(steps.split()[-1]) >= 1


def test_admin_routes_need_the_token(live):
    assert live.http.get("/admin/drafter").status_code == 401
    bad = live.http.get("/admin/drafter", headers={"Authorization": "Bearer nope"})
    assert bad.status_code == 403 and bad.json()["error"]["type"] == "permission_error"
    ok = live.http.get("/admin/drafter", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert ok.status_code == 200 and ok.json()["kind"] == "suffix"


# ---------------------------------------------------------------------------- client disconnects


def _aborts(live: Live) -> float:
    return live.metric("specloop_requests_finished_total", {"reason": "abort"})


def test_stream_disconnect_aborts_the_request(live):
    before = _aborts(live)
    body = {
        "model": SERVED,
        "prompt": "Tell me everything",
        "max_tokens": LIMIT,
        "ignore_eos": True,
        "stream": True,
    }
    with live.http.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        first = next(resp.iter_lines())
        assert first.startswith("data: ")
    # the engine would need many seconds to reach max_tokens; an abort ends it right away
    _wait_for(lambda: _aborts(live) > before, "the engine to abort the streamed request")


def test_non_streamed_disconnect_aborts_the_request(live):
    before = _aborts(live)
    body = {
        "model": SERVED,
        "prompt": "Tell me everything",
        "max_tokens": LIMIT,
        "ignore_eos": True,
    }
    with pytest.raises(httpx.ReadTimeout):
        live.http.post("/v1/completions", json=body, timeout=httpx.Timeout(120, read=0.5))
    _wait_for(lambda: _aborts(live) > before, "the engine to abort the request")


@contextlib.contextmanager
def _served(app):
    """``app`` on a real uvicorn server on a free port (clients can really disconnect); its URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    _wait_for(lambda: server.started or not thread.is_alive(), "the server to start")
    assert server.started, "uvicorn did not start"
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)


def _gated_engine(drafters):
    """A one-row engine whose step thread waits at its third draft until ``gate`` is set (the
    first token's reply leaves at the second step's forward: replies are held for it); ``asked``
    is set once it waits. (drafter, engine, settings, gate, asked)."""
    gate, asked = threading.Event(), threading.Event()

    class Gated(drafters.Recording):
        def propose(self, views, k):
            if self.proposed_steps >= 2:
                asked.set()
                assert gate.wait(60)
            return super().propose(views, k)

    drafter = Gated()
    settings = ServingSettings(served_model_name=SERVED, drafter="suffix", k=2, max_batch_size=1,
                               max_tokens_limit=LIMIT)
    return drafter, TorchEngine(tiny_target(), drafter, EngineConfig(k=2, max_batch_size=1)), settings, gate, asked


def test_a_stream_left_while_it_waits_for_a_row_is_aborted_there(drafters):
    """A full engine queues a streamed request; its client gives up before the first token: the
    request is aborted while it waits, never admitted (no prefill, no row), not after a row
    frees up and it has run a step."""
    drafter, engine, settings, gate, asked = _gated_engine(drafters)
    aborted = threading.Event()
    abort = engine.abort

    async def recorded_abort(request_id):
        aborted.set()
        await abort(request_id)

    engine.abort = recorded_abort
    body = {"model": SERVED, "prompt": "Tell me", "max_tokens": 6, "ignore_eos": True,
            "stream": True}
    try:
        with _served(create_app(engine, settings, CollectorRegistry())) as url, \
                httpx.Client(base_url=url, timeout=120) as http:
            with http.stream("POST", "/v1/completions", json=body) as holder:
                lines = holder.iter_lines()
                assert holder.status_code == 200 and next(lines).startswith("data: ")
                assert asked.wait(60)  # the holder's row is mid-step: the engine is full
                with pytest.raises(httpx.ReadTimeout):  # no status line while it waits
                    http.post("/v1/completions", json=body, timeout=httpx.Timeout(120, read=0.5))
                assert aborted.wait(20), "the server did not abort the request its client left"
                gate.set()
                rest = [line for line in lines if line]
            # the holder's other 5 tokens, in as many chunks as the steps that emitted them (an
            # accepted draft brings two: counting chunks failed a full run once)
            texts = [json.loads(line.removeprefix("data: "))["choices"][0] for line in rest[:-1]]
            assert rest[-1] == "data: [DONE]" and texts[-1]["finish_reason"] == "length"
            assert "".join(t["text"] for t in texts)  # the rest of its answer reached it
            _wait_for(lambda: engine.load() == (0, 0), "the engine to drain")
    finally:
        gate.set()
        asyncio.run(engine.stop())
    assert len(drafter.added) == 1, drafter.added.keys()  # the left request never got a row


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_the_engine_stops_under_is_a_503_not_a_truncated_answer(drafters, stream):
    """The engine stops (shutdown) while a request is mid-generation: the engine ends it "abort",
    which is no OpenAI finish_reason; a 200 with the text so far passed a truncated answer off as
    a whole one. A non-streamed client gets 503 (retry elsewhere), a stream an in-band error."""
    _, engine, settings, gate, asked = _gated_engine(drafters)
    body = {"model": SERVED, "prompt": "Tell me", "max_tokens": 12, "ignore_eos": True, "stream": stream}
    stopper = threading.Thread(target=lambda: asyncio.run(engine.stop()))
    try:
        with _served(create_app(engine, settings, CollectorRegistry())) as url, \
                httpx.Client(base_url=url, timeout=120) as http:
            if stream:
                with http.stream("POST", "/v1/completions", json=body) as resp:
                    lines = resp.iter_lines()
                    assert resp.status_code == 200 and next(lines).startswith("data: ")
                    assert asked.wait(60)
                    stopper.start()
                    gate.set()
                    events = [line for line in lines if line]
                assert events[-1] == "data: [DONE]"
                error = json.loads(events[-2].removeprefix("data: "))["error"]
                assert "stopped before finishing" in error["message"]
                assert all('"abort"' not in e for e in events)
            else:
                answer = {}
                client = threading.Thread(target=lambda: answer.update(r=http.post("/v1/completions", json=body)))
                client.start()
                assert asked.wait(60)
                stopper.start()
                gate.set()
                client.join(60)
                resp = answer["r"]
                assert resp.status_code == 503 and resp.headers.get("retry-after")
                assert "stopped before finishing" in resp.json()["error"]["message"]
            stopper.join(60)
    finally:
        gate.set()
        if stopper.is_alive():
            stopper.join(60)


# ---------------------------------------------------------------------------- bad input


def _chat(live, **kw):
    kw.setdefault("model", SERVED)
    kw.setdefault("messages", [{"role": "user", "content": "hi"}])
    return live.client.chat.completions.create(**kw)


def _completion(live, **kw):
    kw.setdefault("model", SERVED)
    kw.setdefault("prompt", "hi")
    return live.client.completions.create(**kw)


def _bad(call, *words, param=None, exc=openai.BadRequestError):
    with pytest.raises(exc) as info:
        call()
    error = info.value.body
    assert isinstance(error, dict) and error["type"], error
    for word in words:
        assert word in error["message"], (word, error["message"])
    if param is not None:
        assert error["param"] == param
    return error


def test_unknown_model_is_404(live):
    err = _bad(
        lambda: _chat(live, model="gpt-4o"),
        "gpt-4o",
        "does not exist",
        param="model",
        exc=openai.NotFoundError,
    )
    assert err["code"] == "model_not_found"
    _bad(lambda: live.client.models.retrieve("gpt-4o"), "gpt-4o", exc=openai.NotFoundError)


def test_empty_messages_and_prompts(live):
    _bad(lambda: _chat(live, messages=[]), "at least one message", param="messages")
    _bad(lambda: _completion(live, prompt=""), "prompt must not be empty", param="prompt")
    _bad(lambda: _completion(live, prompt=[]), "prompt must not be empty", param="prompt")
    _bad(lambda: _completion(live, prompt=["a", "b"]), "batched prompts are not supported")


def test_controls_the_engine_does_not_implement_are_400_unless_at_their_defaults(live):
    """Penalties, logit_bias, tools and JSON output would be silently ignored: a 400 naming the
    field. Their no-op values (what many clients send on every request) are served."""
    _bad(lambda: _completion(live, presence_penalty=0.5), "presence_penalty", param="presence_penalty")
    _bad(lambda: _chat(live, frequency_penalty=-1), "frequency_penalty", param="frequency_penalty")
    _bad(lambda: _completion(live, logit_bias={"42": 100}), "logit_bias", param="logit_bias")
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    _bad(lambda: _chat(live, tools=[tool]), "function calling", param="tools")
    _bad(lambda: _chat(live, response_format={"type": "json_object"}), "json_object",
         param="response_format")
    _bad(lambda: _chat(live, top_logprobs=3), "top_logprobs", param="top_logprobs")
    defaults = {"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}}
    assert _completion(live, max_tokens=2, **defaults).choices[0].text is not None
    out = _chat(live, max_tokens=2, tools=[], response_format={"type": "text"}, **defaults)
    assert out.choices[0].message.role == "assistant"


def test_max_tokens_bounds(live):
    _bad(lambda: _completion(live, max_tokens=0), "max_tokens", "greater than or equal to 1")
    _bad(lambda: _chat(live, max_tokens=-3), "max_tokens")
    _bad(lambda: _chat(live, max_completion_tokens=0), "max_completion_tokens")
    _bad(
        lambda: _completion(live, max_tokens=LIMIT + 1),
        str(LIMIT + 1),
        f"limit of {LIMIT}",
        param="max_tokens",
    )


def test_prompt_longer_than_the_context(live):
    ctx = live.engine.max_context
    ids = [42] * (ctx - 10)
    err = _bad(
        lambda: _completion(live, prompt=ids, max_tokens=100), str(ctx), str(ctx - 10), "100"
    )
    assert err["code"] == "context_length_exceeded"
    _bad(lambda: _completion(live, prompt=[42] * ctx, max_tokens=1), str(ctx), "prompt has")
    # unset max_tokens shrinks to the room left instead of failing
    out = _completion(live, prompt=[42] * (ctx - 3), extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3 and out.choices[0].finish_reason == "length"


def test_bad_sampling_parameters(live):
    _bad(lambda: _chat(live, temperature=2.5), "temperature", param="temperature")
    _bad(lambda: _chat(live, temperature=-0.1), "temperature")
    _bad(lambda: _completion(live, top_p=0), "top_p", param="top_p")
    _bad(lambda: _completion(live, top_p=1.5), "top_p")
    _bad(lambda: _completion(live, extra_body={"top_k": -5}), "top_k", param="top_k")
    _bad(lambda: _chat(live, n=2), "only n=1 is supported", param="n")
    _bad(lambda: _completion(live, prompt=[live.engine.vocab_size + 5]), "outside the vocabulary")


def test_malformed_bodies_are_400_not_500(live):
    url = "/v1/chat/completions"
    cases = [
        (b'{"model": "x", "messages": [', "Invalid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b"", "missing"),
        (b'{"messages": "hello"}', "messages"),
        (b'{"messages": [{"role": "wizard", "content": "x"}]}', "role"),
    ]
    for raw, words in cases:
        resp = live.http.post(url, content=raw, headers={"Content-Type": "application/json"})
        assert resp.status_code == 400, (raw, resp.text)
        error = resp.json()["error"]
        assert words in error["message"] and error["type"] == "invalid_request_error", (raw, error)
    resp = live.http.post("/v1/nothing-here", json={})
    assert resp.status_code == 404 and "error" in resp.json()


def test_sampled_request_with_seed_is_reproducible(live):
    kw = {
        "model": SERVED,
        "prompt": "Random words:",
        "max_tokens": 12,
        "temperature": 0.9,
        "top_p": 0.95,
        "seed": 1234,
        "extra_body": {"top_k": 50, "ignore_eos": True},
    }
    a = live.client.completions.create(**kw).choices[0].text
    b = live.client.completions.create(**kw).choices[0].text
    assert a == b


# ---------------------------------------------------------------------------- edge values (audit)


def _post_json(live, path: str, body: dict | bytes):
    if isinstance(body, bytes):
        return live.http.post(path, content=body, headers={"Content-Type": "application/json"})
    return live.http.post(path, json=body)


def test_explicit_nulls_mean_the_default(live):
    """OpenAI's schema makes these fields nullable and some clients send every field: a null is
    the default (n=1, no stream, no echo, no logprobs), not a 400."""
    common = {"model": SERVED, "max_tokens": 2, "n": None, "stream": None, "user": None}
    out = _post_json(live, "/v1/completions", {**common, "prompt": "hi", "echo": None})
    assert out.status_code == 200, out.text
    assert out.json()["object"] == "text_completion"
    chat = {**common, "messages": [{"role": "user", "content": "hi"}], "logprobs": None}
    out = _post_json(live, "/v1/chat/completions", chat)
    assert out.status_code == 200, out.text
    assert out.json()["object"] == "chat.completion"


def test_a_huge_top_k_is_no_cut_not_a_500(live):
    """top_k at or above the vocabulary cuts nothing; a value past int64 used to fail the engine
    step (and with it every request in the batch)."""
    kw = {"model": SERVED, "prompt": "Random words:", "max_tokens": 6, "temperature": 0.8,
          "seed": 5, "ignore_eos": True}
    uncut = live.http.post("/v1/completions", json=kw).json()["choices"][0]["text"]
    for top_k in (live.engine.vocab_size, 2**70):
        out = live.http.post("/v1/completions", json={**kw, "top_k": top_k})
        assert out.status_code == 200, (top_k, out.text)
        assert out.json()["choices"][0]["text"] == uncut, top_k


def test_vanishing_temperature_and_top_p_are_greedy(live):
    """Temperatures and top_p below float32's range used to reach the sampler as 0 (a 500 that
    failed the whole batch) or as denormals (garbage tokens); near 0 both mean greedy."""
    kw = {"model": SERVED, "prompt": "Some words here", "max_tokens": 6, "ignore_eos": True}
    greedy = live.http.post("/v1/completions", json=kw).json()["choices"][0]["text"]
    for extra in ({"temperature": 1e-40}, {"temperature": 1e-50}, {"temperature": 1e-6},
                  {"temperature": 1.0, "top_p": 1e-50, "seed": 1}):
        out = live.http.post("/v1/completions", json={**kw, **extra})
        assert out.status_code == 200, (extra, out.text)
        assert out.json()["choices"][0]["text"] == greedy, extra


def test_text_that_is_not_unicode_is_400(live):
    """A lone UTF-16 surrogate (a JSON string cut in the middle of an emoji) cannot be tokenised:
    400 naming the field, not a 500."""
    cases = [
        ("/v1/completions", b'{"prompt": "hi \\ud83d", "max_tokens": 2}', "prompt"),
        ("/v1/completions", b'{"prompt": ["\\ud800"], "max_tokens": 2}', "prompt"),
        ("/v1/chat/completions",
         b'{"messages": [{"role": "user", "content": "x\\ud83d"}], "max_tokens": 2}', "messages"),
        ("/v1/chat/completions",
         b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}',
         "messages"),
    ]
    for path, raw, param in cases:
        out = _post_json(live, path, raw)
        assert out.status_code == 400, (raw, out.text)
        error = out.json()["error"]
        assert error["param"] == param and "surrogate" in error["message"], error


def test_max_completion_tokens_errors_name_it(live):
    err = _bad(lambda: _chat(live, max_completion_tokens=LIMIT + 1), str(LIMIT + 1),
               "max_completion_tokens", param="max_completion_tokens")
    assert "max_tokens=" not in err["message"]


def test_a_stream_has_one_created_time(live):
    """Every chunk of a stream carries the same ``id`` and ``created`` (as OpenAI's do)."""
    body = {"model": SERVED, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    now, ticks = time.time(), itertools.count()
    clock = pytest.MonkeyPatch()
    # the API's clock jumps a second per reading: chunks stamped one by one would differ
    clock.setattr(responses, "time", SimpleNamespace(time=lambda: now + next(ticks)))
    try:
        resp = live.http.post("/v1/chat/completions", json=body)
    finally:
        clock.undo()
    events = [json.loads(line[6:]) for line in resp.text.splitlines()
              if line.startswith("data: {")]
    assert len(events) >= 3
    assert len({e["created"] for e in events}) == 1 and len({e["id"] for e in events}) == 1


def test_a_body_without_the_json_content_type_says_so(live):
    """``curl -d '{...}'`` sends form encoding: the 400 should point at the header."""
    resp = live.http.post("/v1/completions", content=b'{"prompt": "hi"}',
                          headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert resp.status_code == 400
    assert "Content-Type: application/json" in resp.json()["error"]["message"]


def test_fields_of_the_wrong_json_type_are_400_not_converted(live):
    """As OpenAI's API: a number sent as a string, a float where an integer goes, a string or a
    number where a boolean goes is a 400 naming the field, not converted (lax parsing served
    "max_tokens": "5" as 5 and "train": "no" as false: a client that works here must work there).
    An integer where a float goes is a number like any other."""
    base = {"model": SERVED, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for field, value in (("max_tokens", "5"), ("max_tokens", 5.0), ("temperature", "0.5"),
                         ("stream", "true"), ("stream", 1), ("train", "no"), ("seed", "7")):
        out = _post_json(live, "/v1/chat/completions", {**base, field: value})
        assert out.status_code == 400, (field, value, out.text)
        assert field in out.json()["error"]["message"], (field, value, out.json())
    out = _post_json(live, "/v1/completions", {"model": SERVED, "prompt": [1, "2"], "max_tokens": 2})
    assert out.status_code == 400, out.text
    for ok in ({"temperature": 1, "top_p": 1}, {"stream": False, "train": False}):
        out = _post_json(live, "/v1/chat/completions", {**base, **ok})
        assert out.status_code == 200, (ok, out.text)


def test_chat_fields_that_would_change_the_answer_are_400_not_ignored(live):
    """An assistant turn with tool calls became an empty turn, a null user message an empty one,
    and a forced tool call, audio or web search were answered with plain text: each is a 400 now.
    Fields that change no output are still accepted."""
    call = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": call},
               {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    _bad(lambda: _chat(live, messages=history), "tool_calls", param="messages")
    _bad(lambda: _chat(live, messages=[{"role": "user", "content": None}]), "needs content", param="messages")
    _bad(lambda: _chat(live, tool_choice="required"), "tool_choice", param="tool_choice")
    _bad(lambda: _chat(live, function_call={"name": "f"}), "function_call", param="function_call")
    _bad(lambda: _chat(live, modalities=["text", "audio"]), "modalities", param="modalities")
    _bad(lambda: _chat(live, audio={"voice": "alloy", "format": "wav"}), "audio", param="audio")
    _bad(lambda: _chat(live, web_search_options={}), "web_search_options", param="web_search_options")
    ok = _chat(live, max_tokens=2, tool_choice="auto", modalities=["text"], store=True,
               metadata={"run": "a"}, messages=[{"role": "user", "content": "hi"},
                                                {"role": "assistant", "content": None},
                                                {"role": "user", "content": "and?"}])
    assert ok.choices[0].finish_reason in ("stop", "length")
    nulls = live.http.post("/v1/chat/completions", json={  # explicit nulls, as some clients send
        "model": SERVED, "max_tokens": 2, "messages": [
            {"role": "user", "content": "hi", "name": None, "tool_calls": None, "tool_call_id": None}]})
    assert nulls.status_code == 200, nulls.text


def test_whole_request_checks_name_their_field_and_unknown_routes_are_openai_shaped(live):
    _bad(lambda: _chat(live, stream_options={"include_usage": True}), "stream=true", param="stream_options")
    _bad(lambda: _chat(live, max_tokens=3, max_completion_tokens=4), "disagree", param="max_completion_tokens")
    r = live.http.post("/v1/no-such-route", json={})
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"


def test_unset_temperature_and_max_tokens_are_openais_defaults():
    """The openai SDK sends neither unless told: an unset temperature is OpenAI's 1.0 (it was
    greedy), an unset max_tokens as many as the context leaves up to the limit (it was 256);
    both are the server's to change (SPECLOOP_DEFAULT_TEMPERATURE, SPECLOOP_DEFAULT_MAX_TOKENS)."""
    from serving.api.openai_serving import OpenAIServing

    engine = TorchEngine(tiny_target(), None, EngineConfig(k=0))
    body = protocol.ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]})
    prompt = list(range(10, 40))

    def params(**settings):
        serving = OpenAIServing(engine, ServingSettings(max_tokens_limit=LIMIT, **settings))
        return serving.engine_request(body, prompt, "messages", "r-1").params

    openai_like = params()
    assert openai_like.temperature == 1.0 and openai_like.max_tokens == LIMIT
    assert params(default_temperature=0.0, default_max_tokens=64).temperature == 0.0
    assert params(default_max_tokens=64).max_tokens == 64
    near_the_end = OpenAIServing(engine, ServingSettings(max_tokens_limit=LIMIT))
    long_prompt = list(range(engine.max_context - 100))
    assert near_the_end.engine_request(body, long_prompt, "messages", "r-2").params.max_tokens == 100
    explicit = protocol.ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_tokens": 5})
    got = near_the_end.engine_request(explicit, prompt, "messages", "r-3").params
    assert (got.temperature, got.max_tokens) == (0.0, 5)
