"""check_request: the one request check both engines run before admitting a request."""

from __future__ import annotations

import math

import numpy as np
import pytest

from serving.engine.base import GenerationRequest, RequestError, SamplingParams
from serving.engine.request_checks import check_request

VOCAB, CONTEXT = 100, 16


def request(prompt=(1, 2, 3), rid="r1", **params) -> GenerationRequest:
    """A request; ``params`` are set after construction, past pydantic's checks (as a direct
    Python caller can)."""
    p = SamplingParams()
    for name, value in params.items():
        setattr(p, name, value)
    return GenerationRequest(rid, list(prompt) if isinstance(prompt, tuple) else prompt, p)


def refused(req, vocab_size=VOCAB, max_context=CONTEXT) -> str:
    with pytest.raises(RequestError) as err:
        check_request(req, vocab_size=vocab_size, max_context=max_context)
    assert err.value.invalid
    return str(err.value)


def test_a_valid_request_passes():
    check_request(request([0, 5, VOCAB - 1], temperature=0.7, top_p=0.9, top_k=5, max_tokens=4,
                          stop_token_ids=[2, np.int64(3)]),
                  vocab_size=VOCAB, max_context=CONTEXT)
    check_request(request([np.int32(1)] * (CONTEXT - 1)), vocab_size=VOCAB, max_context=CONTEXT)


@pytest.mark.parametrize("rid", ["", None, 7])
def test_request_id_must_be_a_non_empty_string(rid):
    assert refused(request(rid=rid)) == "request_id must be a non-empty string"


@pytest.mark.parametrize("prompt", [[], (), None, "1 2 3"])
def test_the_prompt_must_be_a_non_empty_list(prompt):
    req = GenerationRequest("r1", prompt, SamplingParams())
    assert refused(req) == "the prompt is empty"


@pytest.mark.parametrize("bad_id", [VOCAB, -1, 1.0, True, "1", None])
def test_token_ids_must_be_integers_in_the_vocabulary(bad_id):
    assert refused(request([1, bad_id])) == f"prompt token ids must be integers in [0, {VOCAB})"


def test_an_unknown_vocabulary_still_refuses_negative_and_non_integer_ids():
    check_request(request([10**6]), vocab_size=None, max_context=CONTEXT)
    for bad_id in (-1, 2.0, False):
        msg = refused(request([bad_id]), vocab_size=None)
        assert msg == "prompt token ids must be non-negative integers"


def test_the_prompt_must_leave_room_for_one_output_token():
    assert refused(request([1] * CONTEXT)) == (
        f"the prompt has {CONTEXT} tokens; the context holds {CONTEXT} "
        "(prompt + at least one output token)")
    check_request(request([1] * (CONTEXT - 1)), vocab_size=VOCAB, max_context=CONTEXT)
    check_request(request([1] * 1000), vocab_size=VOCAB, max_context=None)  # unknown: unchecked


@pytest.mark.parametrize("temperature", [-0.1, math.nan, math.inf])
def test_temperature_must_be_finite_and_non_negative(temperature):
    assert refused(request(temperature=temperature)) == "temperature must be a finite number >= 0"


@pytest.mark.parametrize("top_p", [0.0, -0.5, 1.01, math.nan])
def test_top_p_must_be_in_0_1(top_p):
    assert refused(request(top_p=top_p)) == "top_p must be in (0, 1]"


@pytest.mark.parametrize("params", [{"top_k": -1}, {"max_tokens": 0}, {"max_tokens": -3}])
def test_top_k_and_max_tokens(params):
    assert refused(request(**params)) == "top_k must be >= 0 and max_tokens >= 1"


@pytest.mark.parametrize("stop_ids", [[1, 2.0], ["2"], [True]])
def test_stop_token_ids_must_be_integers(stop_ids):
    assert refused(request(stop_token_ids=stop_ids)) == "stop_token_ids must be integers"


@pytest.mark.parametrize("stop_id", [VOCAB, -1, 10**9])
def test_stop_token_ids_must_be_in_the_vocabulary(stop_id):
    """The HTTP API refused these (serving/api/openai_serving.py); a direct engine caller's stop id
    that no token has was accepted, and its stop silently never fired."""
    assert refused(request(stop_token_ids=[2, stop_id])) == (
        f"stop_token_ids: token id {stop_id} is outside the vocabulary [0, {VOCAB})")


def test_an_unknown_vocabulary_still_refuses_a_negative_stop_token_id():
    check_request(request(stop_token_ids=[10**6]), vocab_size=None, max_context=CONTEXT)
    assert refused(request(stop_token_ids=[-1]), vocab_size=None) == (
        "stop_token_ids: token id -1 is outside the vocabulary")


def test_the_first_broken_rule_is_named():
    msg = refused(request([VOCAB], top_p=0.0, max_tokens=0))
    assert msg.startswith("prompt token ids")
