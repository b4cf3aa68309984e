"""Opt-out ("train": false) is honoured by the engine: the request's prompt and output never reach
the tenant's shared suffix index, so its continuation is never drafted for another request."""

from __future__ import annotations

import pytest

from serving.drafters.suffix import SuffixDrafter
from serving.engine.base import GenerationRequest, SamplingParams
from serving.engine.config import EngineConfig
from serving.engine.torch_engine import TorchEngine

PROMPT = [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12]


class _SpyDrafter(SuffixDrafter):
    """The real suffix drafter, remembering every index-sourced draft per request."""

    def __init__(self):
        super().__init__()
        self.index_drafts: dict[str, list[list[int]]] = {}

    def propose(self, views, k):
        out = super().propose(views, k)
        for view, d in zip(views, self.last_drafts):
            if d.source == "index" and d.tokens:
                self.index_drafts.setdefault(view.request_id, []).append(list(d.tokens))
        return out


def _serve(ids_target, run, drafter, rid, train):
    engine = TorchEngine(ids_target, drafter, EngineConfig(k=4, max_batch_size=2))
    req = GenerationRequest(
        request_id=rid, prompt_ids=list(PROMPT), params=SamplingParams(max_tokens=40),
        tenant="acme", train=train,
    )
    (chunks,) = run(engine, [req])
    return [t for c in chunks for t in c.token_ids], chunks[-1].stats


@pytest.mark.parametrize("train", [True, False])
def test_opted_out_continuation_is_never_drafted_for_another_request(ids_target, run, train):
    drafter = _SpyDrafter()
    first, _ = _serve(ids_target, run, drafter, "secret", train)
    index = drafter.index("acme")
    # the same prompt again from another client of the tenant: greedy gives the same continuation,
    # so whatever the index holds from the first request would be drafted (and accepted) here
    second, _ = _serve(ids_target, run, drafter, "other", True)
    assert second == first
    if train:  # the control: a training request does teach the index, and it is drafted from
        assert index.num_tokens > 0
        assert drafter.index_drafts.get("other")
    else:
        assert drafter.index_drafts.get("other") is None
        # only the second request's own tokens are in the index now; nothing of "secret" before it
        assert "secret" not in drafter._served


def test_opted_out_request_leaves_the_index_empty(ids_target, run):
    drafter = SuffixDrafter()
    _serve(ids_target, run, drafter, "secret", False)
    assert drafter.index("acme").num_tokens == 0
