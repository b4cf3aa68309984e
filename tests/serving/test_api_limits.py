"""The API's bounds on what a request may cost and ask (audit): stop strings, body size, prompts
refused before tokenising, tokenising off the event loop, /v1/completions' default max_tokens, and
vLLM's and SGLang's extension fields (honoured, refused or, at their no-op value, accepted)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from serving.api import protocol
from serving.api.app import create_app
from serving.api.openai_serving import OpenAIServing
from serving.builder import build_engine
from serving.config import ServingSettings
from serving.engine.reference import target_greedy_reference
from serving.output import max_token_chars
from serving.target import tiny_target

SERVED = "tiny-smol"
LIMIT = 1500  # max_tokens limit; the tiny model's context is 2048
BODY_LIMIT = 512 * 1024
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


class _Watched:
    """The engine's tokenizer, noting each encode and chat templating and whether an event loop
    was running in the thread that called it."""

    def __init__(self, tokenizer):
        self._tok, self.calls = tokenizer, []

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def _note(self, what: str) -> None:
        try:
            asyncio.get_running_loop()
            self.calls.append((what, "event loop"))
        except RuntimeError:
            self.calls.append((what, "worker thread"))

    def encode(self, *args, **kwargs):
        self._note("encode")
        return self._tok.encode(*args, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        self._note("chat template")
        return self._tok.apply_chat_template(*args, **kwargs)


@pytest.fixture(scope="module")
def api():
    settings = ServingSettings(served_model_name=SERVED, drafter="suffix", k=4, max_batch_size=4,
                               default_temperature=0.0, max_tokens_limit=LIMIT, max_body_bytes=BODY_LIMIT)
    target, registry = tiny_target(), CollectorRegistry()
    engine = build_engine(settings, target=target, registry=registry)
    engine.tokenizer = _Watched(engine.tokenizer)
    app = create_app(engine, settings, registry)
    with TestClient(app) as client:
        yield SimpleNamespace(client=client, engine=engine, target=target, tok=engine.tokenizer,
                              settings=settings)


def _post(api, path: str, **body):
    if path == CHAT:
        body.setdefault("messages", [{"role": "user", "content": "hi"}])
    else:
        body.setdefault("prompt", "hi")
    return api.client.post(path, json={"model": SERVED, **body})


def _refused(resp, param: str, *words: str) -> dict:
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    for word in words:
        assert word in error["message"], (word, error)
    return error


# ---------------------------------------------------------------------------- stop strings


def test_stop_strings_are_bounded_in_number_and_length(api):
    n, chars = 16, 1024
    _refused(_post(api, COMPLETIONS, stop=[f"s{i}" for i in range(n + 1)]), "stop", str(n + 1))
    _refused(_post(api, CHAT, stop="x" * (chars + 1)), "stop", str(chars + 1))
    most = [f"Z{i}".ljust(chars, "q") for i in range(n)]
    ok = _post(api, COMPLETIONS, stop=most, max_tokens=3, ignore_eos=True)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3, ok.text
    assert (protocol.MAX_STOP_STRINGS, protocol.MAX_STOP_CHARS) == (n, chars)


# ---------------------------------------------------------------------------- body and prompt size


def test_a_body_over_the_limit_is_413_before_it_is_read(api):
    resp = api.client.post(COMPLETIONS, content=b"x" * (BODY_LIMIT + 1),
                           headers={"Content-Type": "application/json"})
    assert resp.status_code == 413, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and str(BODY_LIMIT) in error["message"]


def test_a_chunked_body_is_413_once_it_passes_the_limit(api):
    sent = []

    def chunks():  # no Content-Length: the server counts what it reads
        for _ in range(BODY_LIMIT // 65536 + 4):
            sent.append(1)
            yield b" " * 65536

    resp = api.client.post(COMPLETIONS, content=chunks(), headers={"Content-Type": "application/json"})
    assert resp.status_code == 413, resp.text
    assert str(BODY_LIMIT) in resp.json()["error"]["message"]


def test_a_prompt_longer_than_any_tokenisation_fits_is_refused_without_tokenising(api):
    """N characters are at least N / (the longest token's characters) tokens: a prompt that
    cannot fit is refused without the seconds tokenising megabytes takes."""
    ctx = api.engine.max_context
    big = "hello world " * 35_000  # 420k characters: more than 82 per token over the context
    before = len(api.tok.calls)
    completion = _post(api, COMPLETIONS, prompt=big, max_tokens=2)
    chat = _post(api, CHAT, messages=[{"role": "user", "content": big}])
    assert api.tok.calls[before:] == []  # neither tokenised nor templated
    err = _refused(completion, "prompt", str(ctx), "at least")
    assert err["code"] == "context_length_exceeded"
    err = _refused(chat, "messages", str(ctx))
    assert err["code"] == "context_length_exceeded"
    # one that may fit is tokenised, and then measured exactly
    near = _post(api, COMPLETIONS, prompt="hello world " * 300, max_tokens=2)
    assert near.status_code == 200, near.text


def test_the_characters_per_token_bound_holds_and_is_off_where_text_may_shrink(api):
    tok = api.target.tokenizer
    per_token = max_token_chars(tok)
    longest = "\n" + " " * 80  # SmolLM2's longest token
    for text in (longest * 50, "hello world " * 200, "<|im_start|>user<|im_end|>" * 30,
                 "🎉👍🏽 日本語 naïve — ok " * 40, "x" * 3000):
        assert len(tok.encode(text)) >= len(text) / per_token, text[:30]
    # a normaliser that composes characters (NFC) or a pre-tokeniser that drops whitespace: the
    # text may shrink before it is split, so no bound
    for part, value in (("normalizer", normalizers.NFC()), ("pre_tokenizer", pre_tokenizers.Whitespace())):
        backend = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
        setattr(backend, part, value)
        assert max_token_chars(SimpleNamespace(backend_tokenizer=backend)) is None, part
    assert max_token_chars(None) is None


def test_tokenising_and_chat_templating_run_off_the_event_loop(api):
    """The event loop serves every stream: a long prompt tokenised there stalled the others."""
    before = len(api.tok.calls)
    assert _post(api, COMPLETIONS, max_tokens=1).status_code == 200
    assert _post(api, CHAT, max_tokens=1).status_code == 200
    calls = api.tok.calls[before:]
    assert {what for what, _ in calls} == {"encode", "chat template"}, calls
    assert all(where == "worker thread" for _, where in calls), calls


# ---------------------------------------------------------------------------- max_tokens defaults


def test_completions_default_to_16_tokens(api):
    out = _post(api, COMPLETIONS, prompt="Hello", ignore_eos=True).json()
    assert out["usage"]["completion_tokens"] == 16 and out["choices"][0]["finish_reason"] == "length"
    assert protocol.COMPLETION_DEFAULT_MAX_TOKENS == 16


def test_unset_max_tokens_per_endpoint_and_server_default(api):
    """Completions: 16 (OpenAI's legacy default, vLLM's); chat: what the context leaves, up to the
    limit (OpenAI's chat); the server's default_max_tokens, where set, for both; all shortened to
    the room the prompt leaves."""
    completion = protocol.CompletionRequest.model_validate({"prompt": "hi"})
    chat = protocol.ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]})
    prompt, long_prompt = list(range(10, 40)), list(range(api.engine.max_context - 5))

    def max_tokens(req, ids=prompt, **settings):
        serving = OpenAIServing(api.engine, api.settings.model_copy(update=settings))
        return serving.engine_request(req, ids, "prompt", "r").params.max_tokens

    assert (max_tokens(completion), max_tokens(chat)) == (16, LIMIT)
    assert (max_tokens(completion, default_max_tokens=64), max_tokens(chat, default_max_tokens=64)) == (64, 64)
    assert max_tokens(completion, max_tokens_limit=8) == 8
    assert (max_tokens(completion, long_prompt), max_tokens(chat, long_prompt)) == (5, 5)


# ---------------------------------------------------------------------------- extension fields


@pytest.mark.parametrize("stream", [False, True])
def test_stop_token_ids_end_the_request_at_that_token(api, stream):
    """vLLM's and SGLang's ``stop_token_ids``: the request ends at the first one, counted as an
    output token but not in the text (as EOS), finish_reason "stop"."""
    tok = api.target.tokenizer

    def first_new_token(prompt):  # (prompt, its greedy tokens, where one first differs)
        ids = target_greedy_reference(api.target.model, tok.encode(prompt), 12)
        return prompt, ids, next((i for i in range(2, len(ids)) if ids[i] not in ids[:i]), None)

    # the tiny random model tends to repeat a token: take a prompt where a new one comes
    candidates = ("Hello there, general", "Random words:", "Once upon a time", "Lists: one, two,")
    prompt, ids, at = next(c for c in map(first_new_token, candidates) if c[2] is not None)
    body = {"prompt": prompt, "max_tokens": 12, "ignore_eos": True, "stop_token_ids": [ids[at]]}
    if stream:
        resp = _post(api, COMPLETIONS, stream=True, stream_options={"include_usage": True}, **body)
        events = [json.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: {")]
        text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
        finish = [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1]
        usage = events[-1]["usage"]
    else:
        out = _post(api, COMPLETIONS, **body).json()
        text, finish, usage = out["choices"][0]["text"], out["choices"][0]["finish_reason"], out["usage"]
    assert (text, finish) == (tok.decode(ids[:at], skip_special_tokens=True), "stop")
    assert usage["completion_tokens"] == at + 1


UNSUPPORTED = [  # (route, field, a value that would change the output, its no-op value)
    (COMPLETIONS, "min_tokens", 4, 0),
    (COMPLETIONS, "repetition_penalty", 1.3, 1.0),
    (CHAT, "min_p", 0.1, 0),
    (COMPLETIONS, "include_stop_str_in_output", True, False),
    (CHAT, "no_stop_trim", True, False),
    (COMPLETIONS, "spaces_between_special_tokens", False, True),
    (COMPLETIONS, "guided_json", {"type": "object"}, None),
    (CHAT, "guided_choice", ["yes", "no"], []),
    (COMPLETIONS, "guided_regex", "[ab]+", ""),
    (CHAT, "guided_grammar", "root ::= 'a'", None),
    (COMPLETIONS, "regex", "a+", None),
    (CHAT, "ebnf", "root ::= 'a'", None),
    (CHAT, "json_schema", "{}", None),
    (CHAT, "structural_tag", "{}", None),
    (COMPLETIONS, "response_format", {"type": "json_object"}, {"type": "text"}),
    (CHAT, "continue_final_message", True, False),
    (CHAT, "add_generation_prompt", False, True),
    (CHAT, "chat_template_kwargs", {"enable_thinking": False}, {}),
    (CHAT, "chat_template", "{{ messages }}", None),
    (CHAT, "echo", True, False),
    (CHAT, "add_special_tokens", True, False),
    (COMPLETIONS, "add_special_tokens", False, True),
    (COMPLETIONS, "truncate_prompt_tokens", 4, None),
    (COMPLETIONS, "prompt_logprobs", 1, None),
    (COMPLETIONS, "allowed_token_ids", [1, 2], []),
    (COMPLETIONS, "use_beam_search", True, False),
    (COMPLETIONS, "length_penalty", 0.5, 1.0),
    (COMPLETIONS, "return_tokens_as_token_ids", True, False),
    (COMPLETIONS, "priority", 3, 0),
    (CHAT, "lora_path", "adapter", None),
]


@pytest.mark.parametrize("path, field, bad, noop", UNSUPPORTED)
def test_extensions_the_engines_do_not_implement_are_400_unless_at_their_no_op_value(
        api, path, field, bad, noop):
    _refused(_post(api, path, max_tokens=1, **{field: bad}), field, field)
    ok = _post(api, path, max_tokens=1, **{field: noop})
    assert ok.status_code == 200, ok.text


def test_fields_that_change_no_output_are_still_ignored(api):
    """openai-python and others send these; refusing them would break clients for nothing."""
    extra = {"store": False, "metadata": {"run": "a"}, "parallel_tool_calls": True,
             "service_tier": "auto", "guided_decoding_backend": "xgrammar", "request_id": "r-1"}
    for path in (COMPLETIONS, CHAT):
        ok = _post(api, path, max_tokens=1, **extra)
        assert ok.status_code == 200, (path, ok.text)


def test_a_tool_message_is_400(api):
    """Function calling is not supported: a tool result was rendered as a turn of its own."""
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Let me see."},
               {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    _refused(_post(api, CHAT, messages=history, max_tokens=1), "messages", "tool message")
