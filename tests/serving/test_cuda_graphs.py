"""StepGraphs (serving/engine/cuda_graphs.py): decode and verify steps as CUDA graphs.

On a CPU the graphs' static-shape forward runs eagerly (``capture=False``): widths padded to a
power of two, attention over a power-of-two read of the cache under the padded mask, the
keys/values written at static columns, inputs copied into static buffers, graphs made in advance
on fixed stores. These tests check it computes what the eager forward computes, step by step and
through the engine, and that a batch replays the graphs made before it ran. With ``SPECLOOP_TEST_DEVICE=cuda`` (benchmarks/gpu_check.sh) the
same tests capture and replay real graphs.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from kernels.tree_verify import tree_ancestors, tree_depths
from serving.engine.base import GenerationRequest, SamplingParams
from serving.engine.config import EngineConfig
from serving.engine.cuda_graphs import StepGraphs
from serving.engine.model_runner import ModelRunner
from serving.engine.reference import target_greedy_reference
from serving.engine.torch_engine import TorchEngine

PROMPTS = [[5, 17, 3, 44, 9], [60, 2, 2, 71, 13, 8, 30, 1], [11], [90, 12, 40], [7, 7, 7, 7, 3, 99]]


def _graphed(runner: ModelRunner, **kw) -> StepGraphs:
    graphs = StepGraphs(runner.fast, capture=runner.device.type == "cuda", **kw)
    runner.graphs = graphs
    return graphs


def _runners(target):
    eager = ModelRunner(target.model, target.device, cuda_graphs=False)
    graphed = ModelRunner(target.model, target.device)
    return eager, graphed, _graphed(graphed)


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a.float().cpu(), b.float().cpu(), atol=2e-5, rtol=1e-4)


def test_graphed_steps_compute_what_the_eager_forward_does(ids_target):
    """Decode, chain verify and tree verify steps over a ragged batch of a cache that grows (its
    buffers move, and new graphs follow): logits and the cache agree with the eager forward's at
    every step."""
    eager, graphed, graphs = _runners(ids_target)
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        caches = []
        for runner in (eager, graphed):
            cache = runner.new_cache(max_rows=2)
            for prompt in ([5, 17, 3, 44, 9, 2], [60, 2, 71]):
                row, _ = runner.prefill(prompt)
                cache.append(row)
            caches.append(cache)
        start_capacity = caches[1].capacity
        tree_parents = torch.tensor([[-1, 0, 0, 1, 1], [-1, 0, 1, 1, 2]])  # [B, q]: two 5-node trees
        for step in range(110):
            q = (1, 5, 5)[step % 3]
            ids = torch.randint(0, 101, (2, q), generator=gen)
            tree = step % 3 == 2
            outs = []
            for runner, cache in zip((eager, graphed), caches):
                if tree:
                    cache.set_tree(tree_depths(tree_parents), tree_ancestors(tree_parents))
                outs.append(runner.forward(cache, ids).logits)
                if tree:
                    cache.commit_paths([[0, 2], [0, 1, 3]])
                else:
                    cache.commit([q, max(1, q - 2)])
            _close(outs[0], outs[1])
        assert caches[1].capacity > start_capacity  # the buffers moved: new graphs were made
        for a, b in zip(caches[0].keys + caches[0].values, caches[1].keys + caches[1].values):
            for row, n in enumerate(caches[0].lengths):
                _close(a[row, :, :n], b[row, :, :n])
    assert caches[0].lengths == caches[1].lengths
    shapes = {key[:3] for key in graphs._graphs}  # (rows, width, read)
    assert {(2, 1), (2, 8)} <= {s[:2] for s in shapes}  # 5 tokens padded to 8
    assert {256} < {s[2] for s in shapes}  # reads of 256 columns, then more


def test_prefills_features_and_wide_forwards_stay_eager(ids_target):
    _, graphed, graphs = _runners(ids_target)
    with torch.inference_mode():
        cache, _ = graphed.prefill(list(range(1, 40)))  # 38 tokens at once, logits of the last
        assert not graphs._graphs
        assert not graphs.applies(cache, 1, 0, (-1,))  # a drafter wants hidden states
        assert not graphs.applies(cache, graphs.max_tokens + 1, 0, ())
        assert graphs.applies(cache, 4, 0, ())


def test_no_graphs_are_made_in_advance_for_a_drafter_that_wants_hidden_states(ids_target):
    _, graphed, graphs = _runners(ids_target)
    graphed.feature_layers = (-1,)  # an EAGLE drafter's features: its steps stay eager
    cache = graphed.new_batch_cache(max_rows=2, max_context=300, widest=5)
    assert cache.fixed_capacity is not None and not graphs._graphs


def test_least_recently_used_graphs_are_dropped(ids_target):
    graphed = ModelRunner(ids_target.model, ids_target.device)
    graphs = _graphed(graphed, max_graphs=2)
    with torch.inference_mode():
        cache, _ = graphed.prefill([3, 4, 5])
        for q in (1, 2, 3, 1):
            graphed.forward(cache, torch.ones(1, q, dtype=torch.long))
            cache.commit([q])
    assert [key[1] for key in graphs._graphs] == [4, 1]  # widths: 3 tokens run as 4


def test_precaptured_graphs_serve_a_changing_batch_without_new_ones(ids_target):
    """On fixed stores, the graphs made before any request ran are the ones a batch replays while
    rows join and leave and contexts grow past a read bucket: no graph is made while serving (on
    a GPU each would cost ~90 ms), and every step's logits equal the eager forward's."""
    eager, graphed, graphs = _runners(ids_target)
    cache = graphed.new_batch_cache(max_rows=3, max_context=600, widest=5)
    plain = eager.new_cache(max_rows=3)
    assert cache.fixed_capacity == 768 and cache.batch_size == 0
    made = len(graphs._graphs)
    assert made == 3 * 2 * 4  # rows 1..3, reads of 256 and 512 columns, widths 1, 2, 4, 8
    stores = None
    gen = torch.Generator().manual_seed(1)
    prompts = [[5, 17, 3, 44, 9, 2], [60, 2, 71], list(range(1, 30)), [8, 8, 1]]
    with torch.inference_mode():
        for step in range(220):
            if step in (0, 10, 40, 90):  # a row joins
                prompt = prompts[(0, 10, 40, 90).index(step)]
                for runner, c in ((eager, plain), (graphed, cache)):
                    c.append(runner.prefill(prompt)[0])
            if step in (60, 120):  # the first row leaves
                for c in (plain, cache):
                    c.drop_rows({0})
            stores = stores or [t.data_ptr() for t in cache.keys]
            q = 1 + step % 5
            ids = torch.randint(0, 101, (cache.batch_size, q), generator=gen)
            want = eager.forward(plain, ids).logits
            got = graphed.forward(cache, ids).logits
            _close(want, got)
            kept = [1 + (step + b) % q for b in range(cache.batch_size)]
            plain.commit(kept)
            cache.commit(kept)
    assert max(cache.lengths) > 256  # past the first read bucket
    assert len(graphs._graphs) == made  # nothing captured while serving
    assert [t.data_ptr() for t in cache.keys] == stores  # the stores never moved


@pytest.mark.parametrize("k", [0, 4])
def test_engine_on_graphed_steps_is_lossless(ids_target, run, drafters, k):
    """Greedy outputs through the engine with every decode/verify step on the graphs' path equal
    target-only decoding of the reference forward, with a drafter that is right and wrong."""
    refs = {tuple(p): target_greedy_reference(ids_target.model, p, 40) for p in PROMPTS}
    drafter = drafters.Replay(refs, vocab=101, corrupt_every=3) if k else None
    engine = TorchEngine(ids_target, drafter, EngineConfig(k=k, max_batch_size=3))
    graphs = _graphed(engine.runner)
    engine._cache = engine._new_cache()  # the batch cache as it is made with graphs: fixed stores
    reqs = [GenerationRequest(request_id=f"r{i}", prompt_ids=p, params=SamplingParams(max_tokens=40))
            for i, p in enumerate(PROMPTS)]
    outs = run(engine, reqs, delays=[0.0, 0.005, 0.01, 0.0, 0.02])
    for p, chunks in zip(PROMPTS, outs):
        assert [t for c in chunks for t in c.token_ids] == refs[tuple(p)]
    assert graphs._graphs  # the steps went through it
    if engine.runner.device.type == "cuda":
        assert graphs.captures > 0
    if k:
        assert sum(c[-1].stats.accepted_tokens for c in outs) > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a capture that fails: no CUDA here")
def test_a_failed_capture_falls_back_to_the_eager_forward(ids_target):
    """A capture that raises (here: no CUDA at all) leaves the step to the eager forward, and every
    later step too, instead of failing the batch."""
    eager, graphed, _ = _runners(ids_target)
    graphs = graphed.graphs = StepGraphs(graphed.fast, capture=True)
    with torch.inference_mode():
        caches = [runner.prefill([4, 8, 15, 16, 23])[0] for runner in (eager, graphed)]
        ids = torch.tensor([[42, 7]])
        positions, mask = caches[1].prepare(2)
        out = graphs(caches[1], ids, positions, mask)
        want = eager.forward(caches[0], ids)
    _close(want.logits, out.logits)
    assert graphs.failure and not graphs.applies(caches[1], 1, 0, ())


def test_a_failed_step_keeps_the_fixed_stores_and_their_graphs(ids_target, monkeypatch):
    """A step that fails mid-forward ends its batch; the engine then serves on the same stores and
    graphs (a new cache would be another allocation of the largest context, and new graphs)."""
    engine = TorchEngine(ids_target, None, EngineConfig(k=0, max_batch_size=2))
    graphs = _graphed(engine.runner)
    engine._cache = engine._new_cache()  # fixed stores, graphs made in advance
    made, real = len(graphs._graphs), StepGraphs.__call__
    stores = [t.data_ptr() for t in engine._cache._stores[0]]
    calls = {"n": 0}

    def failing(self, cache, *args):
        calls["n"] += 1
        if calls["n"] == 3:  # after prepare: the cache has a step pending
            raise RuntimeError("simulated device failure")
        return real(self, cache, *args)

    monkeypatch.setattr(StepGraphs, "__call__", failing)
    ref = target_greedy_reference(ids_target.model, PROMPTS[1], 10)

    async def main():
        await engine.start()
        try:
            failed = [c async for c in engine.generate(GenerationRequest(
                request_id="x", prompt_ids=PROMPTS[0], params=SamplingParams(max_tokens=10)))]
        except Exception as e:  # noqa: BLE001 - the failed request's error is the point
            failed = e
        ok = [t async for c in engine.generate(GenerationRequest(
            request_id="y", prompt_ids=PROMPTS[1], params=SamplingParams(max_tokens=10))) for t in c.token_ids]
        await engine.stop()
        return failed, ok

    failed, ok = asyncio.run(main())
    assert "simulated" in str(failed)
    assert ok == ref
    assert [t.data_ptr() for t in engine._cache._stores[0]] == stores
    assert len(graphs._graphs) == made
