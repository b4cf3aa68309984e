"""The one check of a GenerationRequest, shared by every engine.

The HTTP layer's pydantic models catch most bad input, but engines are also called directly from
Python (benchmarks, the demo, tests), where a bad request would otherwise reach the model runner or
SGLang and fail there unclearly (an SGLang error, a device-side assert). So TorchEngine and
SGLangEngine both call ``check_request`` first in ``generate``, before anything is admitted
(AdmissionGate) or sent to a model: a bad request is refused with ``RequestError(invalid=True)``
(HTTP 400 with the message) and leaves no trace in the engine.
"""

from __future__ import annotations

import math

import numpy as np

from serving.engine.base import GenerationRequest, RequestError


def check_request(request: GenerationRequest, *, vocab_size: int | None,
                  max_context: int | None) -> None:
    """Raise ``RequestError(invalid=True)`` naming the first rule ``request`` breaks.

    ``vocab_size``: token ids (the prompt's and ``stop_token_ids``) must be below it; None (not
    known yet): only non-negative.
    ``max_context``: the prompt must leave room for one output token; None (not known): unchecked.
    """

    def bad(msg: str):
        raise RequestError(msg, invalid=True)

    if not isinstance(request.request_id, str) or not request.request_id:
        bad("request_id must be a non-empty string")
    ids = request.prompt_ids
    if not isinstance(ids, (list, tuple)) or len(ids) == 0:
        bad("the prompt is empty")
    if not all(_is_int(t) for t in ids) or outside_vocab(ids, "prompt", vocab_size):
        bad("prompt token ids must be non-negative integers" if vocab_size is None
            else f"prompt token ids must be integers in [0, {vocab_size})")
    if max_context is not None and len(ids) >= max_context:
        bad(
            f"the prompt has {len(ids)} tokens; the context holds {max_context} "
            "(prompt + at least one output token)"
        )
    p = request.params
    if not (math.isfinite(p.temperature) and p.temperature >= 0):
        bad("temperature must be a finite number >= 0")
    if not (0 < p.top_p <= 1):
        bad("top_p must be in (0, 1]")
    if p.top_k < 0 or p.max_tokens < 1:
        bad("top_k must be >= 0 and max_tokens >= 1")
    if not all(_is_int(t) for t in p.stop_token_ids):
        bad("stop_token_ids must be integers")
    if why := outside_vocab(p.stop_token_ids, "stop_token_ids", vocab_size):
        bad(why)  # one the model can never emit: the stop would silently never fire


def outside_vocab(ids, param: str, vocab_size: int | None) -> str | None:
    """Why integer ``ids`` do not fit the vocabulary, naming ``param`` and the first id outside
    [0, ``vocab_size``) (None: not known yet, as SGLang's until it loads: only a negative one);
    None when all fit. The HTTP API's check too (serving/api/openai_serving.py)."""
    bad = next((t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)), None)
    if bad is None:
        return None
    where = "" if vocab_size is None else f" [0, {vocab_size})"
    return f"{param}: token id {bad} is outside the vocabulary{where}"


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)
