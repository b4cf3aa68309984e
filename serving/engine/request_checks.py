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

    ``vocab_size``: token ids must be below it; None (not known yet): only non-negative.
    ``max_context``: the prompt must leave room for one output token; None (not known): unchecked.
    """

    def bad(msg: str):
        raise RequestError(msg, invalid=True)

    if not isinstance(request.request_id, str) or not request.request_id:
        bad("request_id must be a non-empty string")
    ids = request.prompt_ids
    if not isinstance(ids, (list, tuple)) or len(ids) == 0:
        bad("the prompt is empty")
    if vocab_size is None:
        if not all(_is_int(t) and t >= 0 for t in ids):
            bad("prompt token ids must be non-negative integers")
    elif not all(_is_int(t) and 0 <= t < vocab_size for t in ids):
        bad(f"prompt token ids must be integers in [0, {vocab_size})")
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


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)
