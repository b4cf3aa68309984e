"""SGLangEngine's glue, against a fake sglang whose request classes accept exactly the fields the
contract lists (so the engine cannot send a field the pinned wheel was not checked for)."""

from __future__ import annotations

import asyncio
import hashlib
import pickle
import sys
import types

import pytest
import torch
from safetensors.torch import save_file

from serving.engine.base import GenerationRequest, SamplingParams
from serving.sglang import contract
from serving.sglang.draft_weights import (
    DraftUpdateError,
    update_draft_weights,
    verify_draft_only_update,
)
from serving.sglang.engine import (
    SGLangConfig,
    SGLangEngine,
    finish_reason,
    sglang_sampling_params,
    spec_stats,
)

IO = "sglang.srt.managers.io_struct"


def contract_request_class(name: str):
    """A stand-in for an io_struct request: keyword fields restricted to the contract's."""
    allowed = {s.name.split(".", 1)[1] for s in contract.SYMBOLS
               if s.module == IO and s.name.startswith(name + ".")}

    def build(**fields):
        unknown = set(fields) - allowed
        if unknown:
            raise TypeError(f"{name} has no contract field(s) {sorted(unknown)}")
        return types.SimpleNamespace(kind=name, **fields)

    return build


@pytest.fixture
def fake_sglang(monkeypatch):
    io_struct = types.ModuleType(IO)
    for cls in ("BeginWeightUpdateReqInput", "EndWeightUpdateReqInput",
                "UpdateWeightsFromTensorReqInput", "CheckWeightsReqInput"):
        setattr(io_struct, cls, contract_request_class(cls))
    common = types.ModuleType("sglang.srt.utils.common")
    common.MultiprocessingSerializer = types.SimpleNamespace(serialize=pickle.dumps)
    for name in ("sglang", "sglang.srt", "sglang.srt.managers", "sglang.srt.utils"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, IO, io_struct)
    monkeypatch.setitem(sys.modules, "sglang.srt.utils.common", common)


class FakeSGLang:
    """Target and draft weights behind SGLang's tokenizer-manager calls. ``bug`` simulates the
    field failures: a draft update that is ignored ("stale") or lands in the target ("leak")."""

    def __init__(self, draft: dict, bug: str | None = None, tp_size: int = 2):
        self.weights = {"draft": dict(draft), "target": {"w": torch.ones(3)}}
        self.bug = bug
        self.calls = []
        self.session = None
        self.server_args = types.SimpleNamespace(tp_size=tp_size)
        self.tokenizer_manager = self

    async def begin_weight_update(self, obj, request):
        self.calls.append(("begin", obj.selector))
        self.session = obj.selector
        return True, "ok"

    async def update_weights_from_tensor(self, obj, request):
        assert self.session is not None, "update outside a session"
        self.calls.append(("tensor", obj.selector, obj.flush_cache, len(obj.serialized_named_tensors)))
        role = {"stale": None, "leak": "target"}.get(self.bug, obj.selector)
        if role is not None:
            self.weights[role].update(pickle.loads(obj.serialized_named_tensors[0]))
        return True, "ok"

    async def end_weight_update(self, obj, request):
        self.calls.append(("end",))
        self.session = None
        return True, "ok"

    async def update_weights_from_disk(self, *args, **kwargs):  # pragma: no cover
        raise AssertionError("a draft update must never go through update_weights_from_disk")

    async def check_weights(self, obj, request):
        assert obj.action == "checksum"
        h = hashlib.sha256()
        for name, t in sorted(self.weights[obj.selector].items()):
            h.update(name.encode() + t.numpy().tobytes())
        return True, "ok", [], h.hexdigest()

    async def async_generate(self, input_ids, sampling_params, return_logprob=False, **kw):
        lp = -float(sum(t.float().sum() for t in self.weights["target"].values()))
        return {"meta_info": {"output_token_logprobs": [(lp, 7, None)]}}


@pytest.fixture
def draft_dir(tmp_path):
    tensors = {"embed_tokens.weight": torch.randn(4, 2), "fc.weight": torch.randn(2, 2),
               "d2t": torch.arange(4)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return tmp_path, tensors


def test_draft_update_is_one_draft_only_session(fake_sglang, draft_dir):
    engine = FakeSGLang({})
    new = {"fc.weight": torch.zeros(2, 2)}
    asyncio.run(update_draft_weights(engine, list(new.items())))
    assert engine.calls == [("begin", "draft"), ("tensor", "draft", False, 2), ("end",)]
    assert torch.equal(engine.weights["draft"]["fc.weight"], new["fc.weight"])


def test_a_refused_update_still_closes_the_session(fake_sglang):
    engine = FakeSGLang({})

    async def refuse(obj, request):
        return False, "shape mismatch"

    engine.update_weights_from_tensor = refuse
    with pytest.raises(DraftUpdateError, match="shape mismatch"):
        asyncio.run(update_draft_weights(engine, [("fc.weight", torch.zeros(1))]))
    assert engine.calls[-1] == ("end",) and engine.session is None


def test_self_test_passes_and_restores_the_draft(fake_sglang, draft_dir):
    path, tensors = draft_dir
    engine = FakeSGLang(tensors)
    asyncio.run(verify_draft_only_update(engine, path, [1, 2, 3]))
    for name, t in tensors.items():
        assert torch.equal(engine.weights["draft"][name], t)
    assert all(c[1] == "draft" for c in engine.calls if c[0] in ("begin", "tensor"))


@pytest.mark.parametrize("bug, message", [("stale", "did not change the draft"),
                                          ("leak", "changed the target")])
def test_self_test_catches_stale_and_leaking_updates(fake_sglang, draft_dir, bug, message):
    path, tensors = draft_dir
    with pytest.raises(DraftUpdateError, match=message):
        asyncio.run(verify_draft_only_update(FakeSGLang(tensors, bug=bug), path, [1, 2, 3]))


def test_sampling_params_use_sglang_names():
    p = SamplingParams(temperature=0.7, top_p=0.9, top_k=0, max_tokens=12, seed=3,
                       stop_token_ids=[2], stop=["\n\n"])
    assert sglang_sampling_params(p) == {
        "max_new_tokens": 12, "temperature": 0.7, "top_p": 0.9, "ignore_eos": False,
        "stop_token_ids": [2], "sampling_seed": 3}
    assert sglang_sampling_params(SamplingParams(top_k=5))["top_k"] == 5
    fields = {s.name.split(".", 1)[1] for s in contract.SYMBOLS
              if s.name.startswith("SamplingParams.")}
    assert set(sglang_sampling_params(SamplingParams(top_k=5, seed=1, stop_token_ids=[1]))) <= fields


def test_server_args_are_contract_fields():
    kwargs = SGLangConfig(model_path="/m", draft_path="/d", algorithm="EAGLE3").sglang_kwargs()
    fields = {s.name.split(".", 1)[1] for s in contract.SYMBOLS
              if s.module.startswith("sglang.srt.arg_groups.fields.")}
    assert set(kwargs) <= fields
    assert kwargs["speculative_algorithm"] == "EAGLE3" and kwargs["speculative_num_draft_tokens"] == 5


def test_meta_info_maps_to_spec_stats_and_finish_reasons():
    stats = spec_stats({"spec_verify_ct": 10, "spec_num_proposed_drafts": 40,
                        "spec_num_correct_drafts": 18})
    assert (stats.verify_steps, stats.drafted_tokens, stats.accepted_tokens) == (10, 40, 18)
    assert stats.mean_accept_len == pytest.approx(2.8)
    assert spec_stats({}).verify_steps == 0
    assert finish_reason({"finish_reason": None}) is None
    assert finish_reason({"finish_reason": {"type": "length", "length": 5}}) == "length"
    assert finish_reason({"finish_reason": {"type": "abort", "message": "x"}}) == "abort"


def test_generate_streams_deltas_with_final_stats():
    outputs = [
        {"output_ids": [5, 6], "meta_info": {"finish_reason": None, "prompt_tokens": 3}},
        {"output_ids": [5, 6, 7, 8, 9], "meta_info": {
            "finish_reason": {"type": "stop"}, "prompt_tokens": 3, "completion_tokens": 5,
            "spec_verify_ct": 2, "spec_num_proposed_drafts": 8, "spec_num_correct_drafts": 3}},
    ]
    seen = {}

    class Fake:
        async def async_generate(self, **kwargs):
            seen.update(kwargs)

            async def stream():
                for out in outputs:
                    yield out
            return stream()

    engine = SGLangEngine(SGLangConfig(model_path="/models/tgt", draft_path="/d"))
    engine._engine = Fake()
    request = GenerationRequest("r1", [1, 2, 3], SamplingParams(max_tokens=5))

    async def collect():
        return [c async for c in engine.generate(request)]

    chunks = asyncio.run(collect())
    assert seen["rid"] == "r1" and seen["stream"] is True and seen["input_ids"] == [1, 2, 3]
    assert [c.token_ids for c in chunks] == [[5, 6], [7, 8, 9]]
    assert [c.finished for c in chunks] == [False, True]
    assert chunks[-1].finish_reason == "stop" and chunks[-1].completion_tokens == 5
    assert chunks[-1].stats.accepted_tokens == 3 and chunks[-1].stats.verify_steps == 2
    assert engine.model_name == "tgt" and engine.drafter.kind == "standalone"
