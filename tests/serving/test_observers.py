"""TraceRecorder and SpecMetrics fed by a real TorchEngine on a tiny target."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from feedback.bus import codec
from feedback.bus.sink import InProcessTraceSink
from serving.engine.base import GenerationRequest, SamplingParams
from serving.engine.config import EngineConfig
from serving.engine.reference import target_greedy_reference
from serving.engine.torch_engine import TorchEngine
from serving.metrics import SpecMetrics
from serving.observers import BaseObserver, TraceRecorder

PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12], [42, 42, 42]]


@pytest.fixture(scope="module")
def refs(ids_target):
    return {tuple(p): target_greedy_reference(ids_target.model, p, 40) for p in PROMPTS}


def _req(rid, prompt, train=True, **params):
    return GenerationRequest(
        rid, list(prompt), SamplingParams(**params), tenant="t1", domain="code", train=train
    )


def _tokens(chunks):
    return [t for c in chunks for t in c.token_ids]


def test_trace_records_every_step_with_target_topk(ids_target, refs, run, drafters):
    sink = InProcessTraceSink()
    recorder = TraceRecorder(sink, ids_target.fingerprint)
    drafter = drafters.Replay(refs, vocab=101, corrupt_every=3, version="v7")
    engine = TorchEngine(ids_target, drafter, EngineConfig(k=4, trace_topk=5), [recorder])
    reqs = [
        _req("a", PROMPTS[0], max_tokens=40),
        _req("b", PROMPTS[1], max_tokens=40, temperature=0.7, seed=3),
        _req("private", PROMPTS[2], train=False, max_tokens=40),
    ]
    outs = run(engine, reqs, delays=[0.0, 0.01, 0.0])
    records = {r.request_id: r for r in sink.drain()}
    assert set(records) == {"a", "b"}  # train=False emits nothing
    model = ids_target.model
    for req, chunks in zip(reqs[:2], outs[:2]):
        rec = records[req.request_id]
        out = _tokens(chunks)
        st = rec.steps
        assert rec.output_ids.tolist() == out and rec.prompt_ids.tolist() == req.prompt_ids
        assert int((st.num_accepted.astype(int) + 1).sum()) == len(out)
        assert (
            st.positions.tolist()
            == np.concatenate([[0], np.cumsum(st.num_accepted + 1)[:-1]]).tolist()
        )
        assert rec.drafter_kind == "suffix" and rec.drafter_version == "v7"
        assert (rec.tenant, rec.domain, rec.temperature) == ("t1", "code", req.params.temperature)
        assert st.num_drafted.sum() == chunks[-1].stats.drafted_tokens > 0
        assert st.target_topk_ids.shape[2] == 5
        for s in range(st.num_steps):
            pos, nd, na = int(st.positions[s]), int(st.num_drafted[s]), int(st.num_accepted[s])
            drafts = st.draft_ids[s, :nd].tolist()
            assert drafts[:na] == out[pos : pos + na]  # accepted drafts are the output
            assert (st.draft_ids[s, nd:] == -1).all() and (
                st.target_topk_ids[s, nd + 1 :] == -1
            ).all()
            # the target's top-k at all nd+1 verified positions, discarded branch included
            ctx = req.prompt_ids + out[:pos] + drafts
            with torch.inference_mode():
                logits = model(torch.tensor([ctx])).logits[
                    0, len(req.prompt_ids) + pos - 1 :
                ]  # [nd+1, V]
            logp = torch.log_softmax(logits.float(), dim=-1)
            top = logp.topk(5, dim=-1)
            np.testing.assert_array_equal(st.target_topk_ids[s, : nd + 1], top.indices.numpy())
            np.testing.assert_allclose(
                st.target_topk_logprobs[s, : nd + 1].astype(np.float32),
                top.values.numpy(),
                atol=5e-3,
            )
        # valid on the wire too
        again = codec.decode(codec.encode(rec))
        assert again.output_ids.tolist() == out


def test_trace_is_cut_where_a_stop_token_ends_an_accepted_run(ids_target, refs, run, drafters):
    sink = InProcessTraceSink()
    prompt = PROMPTS[0]
    ref = refs[tuple(prompt)]
    stop_tok = ref[6]
    engine = TorchEngine(
        ids_target,
        drafters.Replay(refs, vocab=101),
        EngineConfig(k=8),
        [TraceRecorder(sink, ids_target.fingerprint)],
    )
    [chunks] = run(engine, [_req("s", prompt, max_tokens=40, stop_token_ids=[stop_tok])])
    [rec] = sink.drain()
    out = ref[: ref.index(stop_tok) + 1]
    assert _tokens(chunks) == out == rec.output_ids.tolist()
    assert rec.finish_reason == "stop"
    last = rec.steps.num_steps - 1
    assert rec.steps.num_accepted[last] == rec.steps.num_drafted[last]  # nothing falsely rejected
    codec.decode(codec.encode(rec))


def test_trace_version_is_the_one_that_proposed_most_steps(
    ids_target, refs, drafters, run, helpers
):
    sink = InProcessTraceSink()
    old = drafters.Garbage(vocab=101, seed=1, version="old")
    new = drafters.Replay(refs, vocab=101, corrupt_every=4, version="new")
    engine = helpers.SwapAfterSteps(2, new).watch(
        TorchEngine(ids_target, old, EngineConfig(k=3), [TraceRecorder(sink, ids_target.fingerprint)])
    )
    run(engine, [_req("v", PROMPTS[1], max_tokens=40)])
    [rec] = sink.drain()
    assert rec.drafter_version == "new"  # two or three 'old' steps, then 'new' ones


def test_trace_carries_target_features_when_captured(ids_target, run):
    sink = InProcessTraceSink()
    recorder = TraceRecorder(sink, ids_target.fingerprint, record_features=True)
    config = EngineConfig(k=0, capture_features=True, feature_layers=(-1,))
    engine = TorchEngine(ids_target, None, config, [recorder])
    prompt = PROMPTS[1]
    [chunks] = run(engine, [_req("h", prompt, max_tokens=12)])
    [rec] = sink.drain()
    full = prompt + _tokens(chunks)
    with torch.inference_mode():
        h = ids_target.model(torch.tensor([full[:-1]]), output_hidden_states=True).hidden_states[
            -1
        ][0]
    expected = h.to(torch.bfloat16).float()  # [len-1, H]
    got = torch.from_numpy(rec.hidden_states.astype(np.int16)).view(torch.bfloat16).float()
    assert rec.hidden_layers == (-1,) and got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)
    codec.decode(codec.encode(rec))


def test_aborted_requests_are_recorded_with_their_reason(ids_target):
    sink = InProcessTraceSink()
    engine = TorchEngine(
        ids_target, None, EngineConfig(k=0), [TraceRecorder(sink, ids_target.fingerprint)]
    )

    async def main():
        await engine.start()
        agen = engine.generate(_req("x", PROMPTS[0], max_tokens=1900, ignore_eos=True))
        await agen.__anext__()
        await engine.abort("x")
        async for _ in agen:
            pass
        await engine.stop()

    asyncio.run(main())
    [rec] = sink.drain()
    assert rec.finish_reason == "abort" and 0 < len(rec.output_ids) < 1900


def test_metrics_count_what_the_requests_report(ids_target, refs, run, drafters):
    registry = CollectorRegistry()
    metrics = SpecMetrics(registry)
    SpecMetrics(registry)  # a second engine on the same registry: no duplicate-name error
    SpecMetrics()  # and on the global one, twice
    SpecMetrics()
    drafter = drafters.Replay(refs, vocab=101, corrupt_every=3, version="v3")
    engine = TorchEngine(ids_target, drafter, EngineConfig(k=4), [metrics])
    outs = run(engine, [_req(f"m{i}", p, max_tokens=30) for i, p in enumerate(PROMPTS)])
    stats = [c[-1].stats for c in outs]

    def value(name, **labels):
        return registry.get_sample_value(name, labels or None)

    assert value("specloop_spec_drafted_tokens_total") == sum(s.drafted_tokens for s in stats)
    assert value("specloop_spec_accepted_tokens_total") == sum(s.accepted_tokens for s in stats)
    assert value("specloop_spec_verify_steps_total") == sum(s.verify_steps for s in stats)
    assert value("specloop_spec_emitted_tokens_total") == 30 * len(PROMPTS)
    assert value("specloop_spec_accept_length_count") == sum(s.verify_steps for s in stats)
    assert value("specloop_requests_finished_total", reason="length") == len(PROMPTS)
    assert value("specloop_spec_verify_batches_total") == engine.steps
    assert value("specloop_drafter_info", kind="suffix", version="v3") == 1

    metrics.on_drafter_change("eagle", "v4")
    assert value("specloop_drafter_info", kind="eagle", version="v4") == 1
    assert value("specloop_drafter_info", kind="suffix", version="v3") is None


def test_a_failing_observer_does_not_hurt_serving(ids_target, refs, run):
    class Broken(BaseObserver):
        wants_topk = True

        def on_step(self, batch):
            raise RuntimeError("observer bug")

        def on_request_finish(self, *args):
            raise RuntimeError("observer bug")

    sink = InProcessTraceSink()
    engine = TorchEngine(
        ids_target, None, EngineConfig(k=0), [Broken(), TraceRecorder(sink, ids_target.fingerprint)]
    )
    [chunks] = run(engine, [_req("o", PROMPTS[0], max_tokens=10)])
    assert _tokens(chunks) == refs[tuple(PROMPTS[0])][:10]
    assert len(sink.drain()) == 1


def test_a_step_reports_what_its_trace_topk_took_only_when_it_computed_one(ids_target, refs, run,
                                                                         drafters):
    """``VerifyBatch.trace_ms``: the step thread's time on the trace's top-k (bench capture adds
    it up), None on steps that traced nothing (an opted-out request, or no recorder at all)."""

    class Steps(BaseObserver):
        def __init__(self):
            self.batches = []

        def on_step(self, batch):
            self.batches.append(batch)

    for with_recorder, train in [(True, True), (True, False), (False, True)]:
        steps = Steps()
        observers = [steps] + ([TraceRecorder(InProcessTraceSink(), ids_target.fingerprint)]
                               if with_recorder else [])
        drafter = drafters.Replay(refs, vocab=101, corrupt_every=3, version="v1")
        engine = TorchEngine(ids_target, drafter, EngineConfig(k=4, trace_topk=5), observers)
        run(engine, [_req("r", PROMPTS[0], train=train, max_tokens=12)])
        times = [b.trace_ms for b in steps.batches]
        assert times
        if with_recorder and train:
            assert all(t is not None and t > 0 for t in times)
        else:
            assert all(t is None for t in times)
