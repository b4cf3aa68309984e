"""SGLangEngine's glue, against a fake sglang whose request classes accept exactly the fields the
contract lists (so the engine cannot send a field the pinned wheel was not checked for)."""

from __future__ import annotations

import asyncio
import hashlib
import pickle
import sys
import types

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from serving.engine.base import GenerationRequest, Overloaded, RequestError, SamplingParams
from serving.sglang import contract
from serving.sglang.config import SGLangConfig
from serving.sglang.draft_weights import (
    DraftUpdateError,
    update_draft_weights,
    verify_draft_only_update,
)
from serving.sglang.engine import SGLangEngine
from serving.sglang.meta_info import finish_reason, sglang_sampling_params, spec_stats

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


# ---- generate: the shared stop rules, observers, traces -------------------------------------------
# The stand-ins below play sglang.Engine's side (a stream of cumulative outputs, abort_request) so
# that our adapter logic can be tested on CPU; the real engine needs a GPU.


class FakeStream:
    """sglang.Engine.async_generate(stream=True) with non-incremental output: each output carries
    every output id so far. ``abort_request`` makes the next output the final "abort" one."""

    def __init__(self, outputs, final_meta=None):
        self.outputs = outputs
        self.final_meta = final_meta or {}
        self.aborted: list[str] = []
        self.tokenizer_manager = self
        self.sent = 0
        self.shut = False

    def abort_request(self, rid):
        self.aborted.append(rid)

    def shutdown(self):
        self.shut = True

    async def async_generate(self, **kwargs):
        self.kwargs = kwargs

        async def stream():
            ids = []
            for out in self.outputs:
                if self.aborted:
                    yield {"output_ids": list(ids), "meta_info": {
                        "finish_reason": {"type": "abort"}, **self.final_meta}}
                    return
                ids = out["output_ids"]
                self.sent += 1
                yield out
        return stream()


def outputs_of(ids: list[int], cuts: list[int], reason=None, **final_meta):
    """Cumulative outputs ending at each cut; the last one finished with ``reason``."""
    outs = [{"output_ids": ids[:c], "meta_info": {"finish_reason": None}} for c in cuts]
    if reason is not None:
        outs[-1]["meta_info"] = {"finish_reason": {"type": reason}, **final_meta}
    return outs


STATS = {"spec_verify_ct": 3, "spec_num_proposed_drafts": 12, "spec_num_correct_drafts": 5}


class Recording:
    def __init__(self):
        self.events = []

    def on_request_start(self, request, prefill_features=None):
        self.events.append(("start", request.request_id, list(request.prompt_ids), request.train))

    def on_request_finish(self, request, output_ids, finish_reason, stats):
        self.events.append(("finish", request.request_id, list(request.prompt_ids),
                            list(output_ids), finish_reason))

    def on_drafter_change(self, kind, version):
        self.events.append(("drafter", kind, version))


@pytest.fixture(scope="module")
def tok():
    from serving.target import load_default_tokenizer

    return load_default_tokenizer()


def text_engine(tok, fake, observers=(), **config):
    engine = SGLangEngine(SGLangConfig(model_path="/models/tgt", draft_path="/d", **config),
                          observers=list(observers), tokenizer=tok)
    engine._engine = fake
    return engine


def run_request(engine, params: SamplingParams, prompt=(1, 2, 3), rid="r1"):
    async def main():
        chunks = [c async for c in engine.generate(GenerationRequest(rid, list(prompt), params))]
        await engine.stop()
        return chunks
    return asyncio.run(main())


def test_a_stop_string_ends_the_request_and_aborts_it_in_sglang(tok):
    ids = tok.encode("alpha beta gamma delta epsilon zeta")
    fake = FakeStream(outputs_of(ids, [2, 4, 6]), final_meta=STATS)
    chunks = run_request(text_engine(tok, fake), SamplingParams(max_tokens=32, stop=["gamma"]))

    assert "".join(c.text for c in chunks) == "alpha beta "
    assert chunks[-1].finished and chunks[-1].finish_reason == "stop"
    kept = [t for c in chunks for t in c.token_ids]
    assert "gamma" in tok.decode(kept) and "gamma" not in tok.decode(kept[:-1])
    assert chunks[-1].completion_tokens == len(kept)
    assert fake.aborted == ["r1"] and fake.sent == 2  # aborted before more output was read
    assert chunks[-1].stats.verify_steps == 3  # from SGLang's final (abort) output
    assert "stop" not in fake.kwargs["sampling_params"]  # stop strings are ours, not SGLang's


def test_a_stop_token_sglang_stopped_on_keeps_its_id_not_its_text(tok):
    ids = tok.encode("alpha beta gamma delta")
    fake = FakeStream(outputs_of(ids, [2, 3], reason="stop", **STATS))  # SGLang includes it
    chunks = run_request(text_engine(tok, fake),
                         SamplingParams(max_tokens=32, stop_token_ids=[ids[2]]))
    assert [t for c in chunks for t in c.token_ids] == ids[:3]
    assert "".join(c.text for c in chunks) == tok.decode(ids[:2])
    assert chunks[-1].finish_reason == "stop" and fake.aborted == []
    assert fake.kwargs["sampling_params"]["stop_token_ids"] == [ids[2]]


def test_an_eos_id_sglang_does_not_know_still_stops_and_aborts(tok):
    ids = tok.encode("alpha beta gamma delta epsilon")
    fake = FakeStream(outputs_of(ids, [1, 3, 5]))
    engine = text_engine(tok, fake)
    engine.eos_ids = frozenset({ids[2]})  # e.g. from generation_config.json only
    chunks = run_request(engine, SamplingParams(max_tokens=32))
    assert [t for c in chunks for t in c.token_ids] == ids[:3]
    assert chunks[-1].finish_reason == "stop" and fake.aborted == ["r1"]
    fake = FakeStream(outputs_of(ids, [1, 3, 5], reason="length"))
    engine = text_engine(tok, fake)
    engine.eos_ids = frozenset({ids[2]})
    chunks = run_request(engine, SamplingParams(max_tokens=5, ignore_eos=True))
    assert [t for c in chunks for t in c.token_ids] == ids[:5]
    assert chunks[-1].finish_reason == "length" and fake.aborted == []


def test_length_releases_text_held_back_for_a_stop_string(tok):
    ids = tok.encode("over the lazy")
    fake = FakeStream(outputs_of(ids, [len(ids)], reason="length", **STATS))
    chunks = run_request(text_engine(tok, fake), SamplingParams(max_tokens=len(ids),
                                                                stop=["lazy cat"]))
    assert "".join(c.text for c in chunks) == "over the lazy"
    assert chunks[-1].finish_reason == "length" and fake.aborted == []


def test_a_request_sglang_refuses_is_invalid():
    fake = FakeStream([{"output_ids": [], "meta_info": {"finish_reason": {
        "type": "abort", "status_code": 400, "message": "input is longer than the context"}}}])
    engine = SGLangEngine(SGLangConfig(model_path="/m", draft_path="/d"))
    engine._engine = fake
    with pytest.raises(RequestError, match="longer than the context") as err:
        run_request(engine, SamplingParams(max_tokens=4))
    assert err.value.invalid


def bad_top_p() -> SamplingParams:
    params = SamplingParams(max_tokens=1)
    params.top_p = 0.0  # past pydantic, as a direct Python caller can
    return params


@pytest.mark.parametrize("prompt, params, message", [
    ([1, 100], SamplingParams(max_tokens=1), r"integers in \[0, 100\)"),  # id >= vocab
    ([1, 2, 3], bad_top_p(), r"top_p must be in \(0, 1\]"),
    ([1] * 32, SamplingParams(max_tokens=1), "the context holds 32"),
    ([], SamplingParams(max_tokens=1), "the prompt is empty"),
    ([1, 2, 3], SamplingParams(max_tokens=1, stop_token_ids=[100]), r"stop_token_ids: token id 100 .*\[0, 100\)"),
])
def test_a_bad_request_is_refused_before_sglang_or_admission(prompt, params, message):
    from feedback.target.fingerprint import TargetFingerprint

    rec = Recording()
    fp = TargetFingerprint(model_id="m", tokenizer_hash="ids", vocab_size=100)
    engine = SGLangEngine(SGLangConfig(model_path="/m", draft_path="/d", max_waiting=0,
                                       server_args={"max_running_requests": 1}),
                          observers=[rec], fingerprint=fp)
    engine.max_context = 32  # as load_metadata sets it (max_position_embeddings)
    fake = engine._engine = HeldStream()
    fake.go.set()

    async def collect(request):
        return [c async for c in engine.generate(request)]

    with pytest.raises(RequestError, match=message) as err:
        asyncio.run(collect(GenerationRequest("r1", prompt, params)))
    assert err.value.invalid
    assert fake.started == [] and rec.events == []  # SGLang and the observers saw nothing
    assert engine.admission.in_flight == set() and engine.load() == (0, 0)
    assert engine.admission.refused == 0
    # its place (the only one) and its id are free: a good request with the same id runs
    chunks = asyncio.run(collect(GenerationRequest("r1", [1, 2, 3], SamplingParams(max_tokens=1))))
    assert chunks[-1].finish_reason == "length" and fake.started == ["r1"]


def test_observers_see_the_prefill_token_as_prompt_and_aborts_on_disconnect():
    rec = Recording()
    fake = FakeStream(outputs_of([10, 11, 12, 13], [1, 3, 4]))
    engine = SGLangEngine(SGLangConfig(model_path="/m", draft_path="/d"), observers=[rec])
    engine._engine = fake

    async def leave_after_two():
        gen = engine.generate(GenerationRequest("r1", [1, 2, 3], SamplingParams(max_tokens=9)))
        first = await gen.__anext__()
        second = await gen.__anext__()
        await gen.aclose()  # the client went away
        return first, second

    asyncio.run(leave_after_two())
    assert rec.events == [("start", "r1", [1, 2, 3], False),  # no collector: no trace
                          ("finish", "r1", [1, 2, 3, 10], [11, 12], "abort")]
    assert engine.admission.in_flight == set()  # the request that was left frees its place


class HeldStream(FakeStream):
    """Every stream waits for ``go`` before its one (final) output: requests stay in flight."""

    def __init__(self):
        super().__init__([])
        self.go = asyncio.Event()
        self.started: list[str] = []

    async def async_generate(self, **kwargs):
        self.started.append(kwargs["rid"])

        async def stream():
            await self.go.wait()
            yield {"output_ids": [5], "meta_info": {"finish_reason": {"type": "length"}}}
        return stream()


def test_requests_beyond_running_plus_waiting_are_refused_and_admitted_once_others_finish():
    engine = SGLangEngine(SGLangConfig(model_path="/m", draft_path="/d", max_waiting=1,
                                       server_args={"max_running_requests": 1}))
    fake = engine._engine = HeldStream()

    async def collect(rid):
        request = GenerationRequest(rid, [1, 2, 3], SamplingParams(max_tokens=1))
        return [c async for c in engine.generate(request)]

    async def main():
        held = [asyncio.ensure_future(collect(rid)) for rid in ("a", "b")]  # 1 running + 1 waiting
        while len(fake.started) < 2:
            await asyncio.sleep(0)
        assert engine.load() == (1, 1)  # what the trainer's heartbeat reads: a queue, not idle
        with pytest.raises(Overloaded, match="capacity"):
            await collect("c")
        fake.go.set()
        done = await asyncio.gather(*held)
        again = await collect("c")  # the finished ones freed their places
        await engine.stop()
        return done, again

    done, again = asyncio.run(main())
    assert [chunks[-1].finish_reason for chunks in done] == ["length", "length"]
    assert again[-1].finish_reason == "length"
    assert fake.started == ["a", "b", "c"]  # the refused request never reached SGLang
    assert engine.admission.refused == 1 and engine.admission.in_flight == set()
    assert engine.load() == (0, 0)


@pytest.mark.parametrize("configured, resolved, limit", [
    ({"max_running_requests": 4}, 48, 6),  # SPECLOOP_MAX_BATCH_SIZE (or server args) wins
    ({}, 48, 50),  # else the running-batch size SGLang resolved
    ({}, None, None),  # none known: unbounded, with a warning
])
def test_the_admission_bound_uses_sglangs_running_batch_size(configured, resolved, limit, caplog):
    engine = SGLangEngine(SGLangConfig(model_path="/m", draft_path="/d", max_waiting=2,
                                       server_args=configured))
    engine._engine = types.SimpleNamespace(
        server_args=types.SimpleNamespace(max_running_requests=resolved))
    with caplog.at_level("WARNING"):
        engine._bound_admission()
    assert engine.admission.limit == limit
    assert ("not enforced" in caplog.text) == (limit is None)


def step_message(rid, prompt_len, root_pos, drafts, accepted, emitted, top_k=2):
    from serving.sglang.exporter import StepMessage
    from serving.sglang.reduction import StepRows

    d = len(drafts)
    rows = StepRows(
        num_drafted=np.array([d], np.int16), num_accepted=np.array([accepted], np.int16),
        root_pos=np.array([root_pos], np.int64), draft_ids=np.array([drafts], np.int32),
        draft_probs=np.full((1, d), np.nan, np.float32), emitted=[emitted],
        target_topk_ids=np.zeros((1, d + 1, top_k), np.int32),
        target_topk_logprobs=np.full((1, d + 1, top_k), -1.0, np.float16))
    return StepMessage([rid], [prompt_len], rows)


@pytest.mark.parametrize("sample_rate, traced", [(1.0, True), (0.0, False)])
def test_traces_are_complete_even_when_steps_arrive_after_the_finish(sample_rate, traced):
    from feedback.bus.sink import InProcessTraceSink
    from feedback.target.fingerprint import TargetFingerprint
    from serving.observers import TraceRecorder

    fp = TargetFingerprint(model_id="m", tokenizer_hash="ids", vocab_size=100)
    sink = InProcessTraceSink()
    recorder = TraceRecorder(sink, fp)
    output = [10, 11, 12, 13, 14]
    fake = FakeStream(outputs_of(output, [1, 3, 5], reason="stop", **STATS))
    engine = SGLangEngine(SGLangConfig(model_path="/m", draft_path="/d",
                                       trace_sample_rate=sample_rate),
                          observers=[recorder], fingerprint=fp)
    engine._engine = fake
    engine._collector = types.SimpleNamespace(close=lambda: None)  # capture on
    # root = last committed token: output[0] (the prefill's) at absolute position 3, then output[2]
    steps = [step_message("r1", 3, 3, [11, 50], 1, [11, 12]),
             step_message("r1", 3, 5, [13, 51, 52], 1, [13, 14])]

    async def main():
        engine._loop = asyncio.get_running_loop()
        chunks = [c async for c in engine.generate(
            GenerationRequest("r1", [1, 2, 3], SamplingParams(max_tokens=9)))]
        # the verify steps come over their own channel, after the final output
        await asyncio.sleep(0.05)
        await asyncio.to_thread(lambda: [engine._on_step(m) for m in steps])
        await engine.stop()
        return chunks

    chunks = asyncio.run(main())
    assert [t for c in chunks for t in c.token_ids] == output
    records = sink.drain()
    assert recorder.failed == 0 and len(records) == (1 if traced else 0)
    if traced:
        r = records[0]
        assert r.prompt_ids.tolist() == [1, 2, 3, 10] and r.output_ids.tolist() == output[1:]
        assert r.steps.positions.tolist() == [0, 2]
        assert r.steps.num_accepted.tolist() == [1, 1]
    assert engine._covered == {}


# ---- drafter swaps through the shared Swapper ------------------------------------------------------


def test_swap_drafter_installs_the_draft_and_announces_it(fake_sglang, draft_dir):
    from serving.sglang.drafts import SGLangDraft

    path, tensors = draft_dir
    rec = Recording()
    engine = SGLangEngine(SGLangConfig(model_path="/m", draft_path=str(path)), observers=[rec])
    fake = FakeSGLang(tensors)
    new = {"fc.weight": torch.zeros(2, 2)}

    async def main():
        engine._loop = asyncio.get_running_loop()
        engine._engine = fake
        await asyncio.to_thread(engine.swap_drafter,
                                SGLangDraft("standalone", "v2", tensors=list(new.items())))
        with pytest.raises(RuntimeError, match="install_draft"):
            engine.swap_drafter(SGLangDraft("standalone", "v3", tensors=[]))
        # a rollback reinstalls the day-0 draft from its directory
        await asyncio.to_thread(engine.swap_drafter,
                                SGLangDraft("standalone", "day0", path=path))

    day0 = engine.drafter
    asyncio.run(main())
    assert day0.path == path and day0.kind == "standalone"
    assert fake.calls[:3] == [("begin", "draft"), ("tensor", "draft", False, 2), ("end",)]
    assert torch.equal(fake.weights["draft"]["fc.weight"], tensors["fc.weight"])
    assert rec.events == [("drafter", "standalone", "v2"), ("drafter", "standalone", "day0")]
    assert engine.drafter.version == "day0"


def test_a_step_is_labelled_with_the_draft_live_when_its_hook_ran(fake_sglang, draft_dir):
    """A step drafted before a swap may reach the engine after it (device copy, export queue,
    socket): it counts for the version that drafted it, not for the new one the rollback watch
    is judging."""
    import time

    from serving.sglang.drafts import SGLangDraft

    path, tensors = draft_dir
    seen = []
    observer = types.SimpleNamespace(on_step=lambda batch: seen.append(batch.drafter_version))
    engine = SGLangEngine(SGLangConfig(model_path="/m", draft_path=str(path)), observers=[observer])
    fake = FakeSGLang(tensors)

    async def main():
        engine._loop = asyncio.get_running_loop()
        engine._engine = fake
        hooked_before = time.monotonic()
        await asyncio.to_thread(engine.swap_drafter,
                                SGLangDraft("standalone", "v2", tensors=[("fc.weight", torch.zeros(2, 2))]))
        hooked_after = time.monotonic()
        for hooked_at in (hooked_before, hooked_after, 0.0):  # 0: a plugin that sends no time
            message = step_message("r1", 3, 3, [11, 50], 1, [11, 12])
            message.hooked_at = hooked_at
            engine._on_step(message)

    asyncio.run(main())
    assert seen == ["day0", "v2", "v2"]
