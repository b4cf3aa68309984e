"""Chat messages and nested fields as vLLM and OpenAI clients send them, through the app on the
tiny random model: text parts joined by newlines, non-text parts refused by type, a message's
``name`` given to the chat template, nulls inside nested objects meaning the default, and
``stop_token_ids`` checked against the vocabulary."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from serving.api.app import create_app
from serving.builder import build_engine
from serving.config import ServingSettings
from serving.target import load_default_tokenizer, tiny_target

SERVED = "tiny-smol"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
# ChatML, as SmolLM2's, plus each message's name where it has one
NAMED_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}"
    "{% if m['name'] is defined %} ({{ m['name'] }}){% endif %}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def api():
    tok = load_default_tokenizer()
    tok.chat_template = NAMED_CHATML
    settings = ServingSettings(served_model_name=SERVED, drafter="suffix", k=4, max_batch_size=4,
                               default_temperature=0.0, max_tokens_limit=64)
    registry = CollectorRegistry()
    engine = build_engine(settings, target=tiny_target(tokenizer=tok), registry=registry)
    with TestClient(create_app(engine, settings, registry)) as client:
        yield client, engine


def _chat(api, messages, **body):
    client, _ = api
    return client.post(CHAT, json={"model": SERVED, "messages": messages, "max_tokens": 4,
                                   "ignore_eos": True, **body})


def _prompt_tokens(api, messages) -> int:
    """What the chat template makes of ``messages``, in tokens (as the server encodes it)."""
    tok = api[1].tokenizer
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(tok.encode(text, add_special_tokens=False))


def _ok(resp) -> dict:
    assert resp.status_code == 200, resp.text
    return resp.json()


def _refused(resp, param: str, *words: str) -> None:
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    for word in words:
        assert word in error["message"], (word, error)


def test_text_parts_are_joined_by_newlines(api):
    """As vLLM joins them: parts "a", "b", "c" are the message "a\\nb\\nc" (they were "abc")."""
    words = ["a", "b", "c"]
    parts = [{"type": "text", "text": w} for w in words]
    joined = [{"role": "user", "content": "\n".join(words)}]
    assert _prompt_tokens(api, joined) != _prompt_tokens(api, [{"role": "user", "content": "abc"}])
    as_parts = _ok(_chat(api, [{"role": "user", "content": parts}], max_tokens=8))
    as_text = _ok(_chat(api, joined, max_tokens=8))
    assert as_parts["usage"]["prompt_tokens"] == _prompt_tokens(api, joined)
    assert as_parts["choices"] == as_text["choices"]


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
    {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    {"type": "file", "file": {"file_id": "f-1"}},
])
def test_a_non_text_part_is_400_naming_its_type(api, part):
    """The model sees text only: a dropped image would be answered about unseen."""
    content = [{"type": "text", "text": "What is this?"}, part]
    _refused(_chat(api, [{"role": "user", "content": content}]), "messages", repr(part["type"]))


def test_a_message_name_reaches_the_chat_template(api):
    """A template that renders names gets them (one that does not ignores them); a null name
    is none; a name must be a string."""
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    named = [plain[0], {**plain[1], "name": "alice"}]
    assert _prompt_tokens(api, named) > _prompt_tokens(api, plain)
    for messages, expected in ((named, named), (plain, plain),
                               ([plain[0], {**plain[1], "name": None}], plain)):
        got = _ok(_chat(api, messages))["usage"]["prompt_tokens"]
        assert got == _prompt_tokens(api, expected), messages
    developer = [{"role": "developer", "content": "Be brief.", "name": "ops"}, plain[1]]
    got = _ok(_chat(api, developer))["usage"]["prompt_tokens"]
    assert got == _prompt_tokens(api, [{**plain[0], "name": "ops"}, plain[1]])
    _refused(_chat(api, [{**plain[1], "name": 7}]), "messages", "name")


def _events(resp) -> list[dict]:
    assert resp.status_code == 200, resp.text
    return [json.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: {")]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_nulls_inside_stream_options_mean_the_default(api, path):
    """openai-python may send ``"include_usage": null``; it, and a null ``stream_options``, mean
    no usage chunk, as leaving them out does."""
    client, _ = api
    body = {"model": SERVED, "max_tokens": 3, "ignore_eos": True, "stream": True,
            **({"messages": [{"role": "user", "content": "hi"}]} if path == CHAT else {"prompt": "hi"})}
    for options in (None, {"include_usage": None}, {}):
        events = _events(client.post(path, json={**body, "stream_options": options}))
        assert events and all(e.get("usage") is None for e in events), options
    with_usage = _events(client.post(path, json={**body, "stream_options": {"include_usage": True}}))
    assert with_usage[-1]["usage"]["completion_tokens"] == 3
    for off in ({"continuous_usage_stats": False}, {"continuous_usage_stats": None}):
        _events(client.post(path, json={**body, "stream_options": off}))
    per_chunk = client.post(path, json={**body, "stream_options": {"continuous_usage_stats": True}})
    _refused(per_chunk, "stream_options", "continuous_usage_stats")


def test_a_null_inside_other_nested_objects_is_the_default(api):
    """``response_format: {"type": null}`` is text; a null text part is a missing one (400)."""
    _ok(_chat(api, [{"role": "user", "content": "hi"}], response_format={"type": None}))
    _refused(_chat(api, [{"role": "user", "content": [{"type": "text", "text": None}]}]),
             "messages", "text")


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_stop_token_ids_outside_the_vocabulary_are_400(api, path):
    """vLLM's and SGLang's ``stop_token_ids`` name tokens: an id no token has is a mistake the
    client should hear of (it was accepted and never matched)."""
    client, engine = api
    vocab = engine.fingerprint.vocab_size
    body = {"model": SERVED, "max_tokens": 2,
            **({"messages": [{"role": "user", "content": "hi"}]} if path == CHAT else {"prompt": "hi"})}
    for bad in (vocab, -1, 2**40):
        resp = client.post(path, json={**body, "stop_token_ids": [5, bad]})
        _refused(resp, "stop_token_ids", "stop_token_ids", str(bad), str(vocab))
    _ok(client.post(path, json={**body, "stop_token_ids": [0, vocab - 1]}))


def test_skip_special_tokens_false_keeps_the_special_tokens_in_the_text():
    """A target whose logits are all equal emits token 0 (SmolLM2's ``<|endoftext|>``) at every
    step: removed from the text by default, kept with ``skip_special_tokens: false`` (vLLM's)."""
    import torch

    target = tiny_target(seed=3)
    with torch.no_grad():
        target.model.lm_head.weight = torch.nn.Parameter(torch.zeros_like(target.model.lm_head.weight))
    target.model.config.tie_word_embeddings = False
    special = target.tokenizer.convert_ids_to_tokens(0)
    assert special in target.tokenizer.all_special_tokens
    settings = ServingSettings(served_model_name=SERVED, drafter="suffix", k=4, max_batch_size=4,
                               default_temperature=0.0, max_tokens_limit=64)
    registry = CollectorRegistry()
    engine = build_engine(settings, target=target, registry=registry)
    body = {"model": SERVED, "prompt": "Hello", "max_tokens": 3, "ignore_eos": True}
    with TestClient(create_app(engine, settings, registry)) as client:
        default = _ok(client.post(COMPLETIONS, json=body))["choices"][0]["text"]
        kept = _ok(client.post(COMPLETIONS, json={**body, "skip_special_tokens": False}))
        streamed = client.post(COMPLETIONS, json={**body, "skip_special_tokens": False, "stream": True})
    assert default == ""
    assert kept["choices"][0]["text"] == special * 3
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines()
              if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == special * 3
