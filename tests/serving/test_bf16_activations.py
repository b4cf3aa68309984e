"""A target served on bf16 activations (EngineConfig.bf16_activations): the forward is the model's
with every projection's input rounded to bf16 and, where the heads are 64 or 128 wide and the CPU
has AVX-512 BF16, its attention on bf16 operands; speculation, token trees included, stays
token-identical to the same engine's target-only decoding."""

from __future__ import annotations

import pytest
import torch

from kernels import decode_attention as da
from kernels import packed_linear
from serving.engine.base import GenerationRequest, SamplingParams
from serving.engine.batch_cache import RaggedKVCache
from serving.engine.config import EngineConfig
from serving.engine.forward_cache import shared_forward
from serving.engine.reference import rounded_arithmetic
from serving.engine.torch_engine import TorchEngine
from serving.target import tiny_target

needs_rounding = pytest.mark.skipif(not packed_linear.rounding_available(),
                                    reason="no bf16 dot product (AVX-512 BF16) or AMX on this CPU")

PROMPTS = [[1, 2, 3, 4, 5], [7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12], [42, 42, 42], [5, 17]]
VOCAB = 101


HIDDEN = [64, 256]
"""Tiny targets' widths: 4 heads of 16 (attention stays fp32) and of 64 (bf16 attention)."""


def _bf16_target(seed: int = 3, hidden: int = 64):
    """A tiny target whose weights are exactly bf16 (as SmolLM2's are): served from bf16 panels."""
    target = tiny_target(vocab_size=VOCAB, hidden_size=hidden, num_layers=2, seed=seed)
    with torch.no_grad():
        for p in target.model.parameters():
            p.copy_(p.bfloat16().float())
    return target


@needs_rounding
@pytest.mark.parametrize("hidden", HIDDEN)
@torch.inference_mode()
def test_the_forward_is_the_model_on_rounded_inputs_and_shares_the_exact_panels(hidden):
    target = _bf16_target(hidden=hidden)
    exact = shared_forward(target.model)
    rounded = shared_forward(target.model, round_activations=True)
    assert rounded is not exact and rounded is shared_forward(target.model, round_activations=True)
    assert rounded.lm_head_served.rounds_activations and not exact.lm_head_served.rounds_activations
    assert rounded.lm_head_served.panels is exact.lm_head_served.panels  # no second copy
    ids = torch.randint(0, VOCAB, (1, 23), generator=torch.Generator().manual_seed(0))
    cache = RaggedKVCache.for_model(target.model, batch_size=1)
    positions, mask = cache.prepare(ids.shape[1])
    got = rounded(ids, positions, mask, cache).logits
    assert rounded.bf16_attention == (hidden == 256 and da.bf16_takes(4, 2, 64))
    with rounded_arithmetic(target.model, attention=rounded.bf16_attention):
        want = target.model(input_ids=ids).logits
    # a sum in another order can round an activation to the neighbouring bf16 value: ~1e-3
    torch.testing.assert_close(got, want, rtol=1e-3, atol=5e-3)
    if rounded.bf16_attention:  # the reference's attention is the kernel's, not fp32's
        with rounded_arithmetic(target.model, attention=False):
            fp32_attention = target.model(input_ids=ids).logits
        assert (got - want).abs().mean() < (got - fp32_attention).abs().mean()
    exact_cache = RaggedKVCache.for_model(target.model, batch_size=1)
    positions, mask = exact_cache.prepare(ids.shape[1])
    assert not torch.equal(got, exact(ids, positions, mask, exact_cache).logits)  # it does round
    # built the other way round (serving's default first, then an exact baseline): one copy too
    other = _bf16_target(seed=4)
    first = shared_forward(other.model, round_activations=True)
    then = shared_forward(other.model)
    assert then.lm_head_served.panels is first.lm_head_served.panels
    assert then.layers[0][1].panels is first.layers[0][1].panels
    assert not then.lm_head_served.rounds_activations and not then.layers[0][1].rounds_activations


def _serve(target, k: int, prompts, max_tokens: int = 30, batch: int = 4) -> list[list[int]]:
    """Greedy outputs of ``prompts`` from an engine on bf16 activations; k > 0 drafts suffix trees."""
    from serving.drafters.suffix import SuffixDrafter

    drafter = SuffixDrafter() if k else None
    engine = TorchEngine(target, drafter, EngineConfig(k=k, max_batch_size=batch, bf16_activations=True))
    assert engine.runner.fast.round_activations

    async def main():
        await engine.start()
        try:
            outs = []
            for i, p in enumerate(prompts):
                req = GenerationRequest(request_id=f"r{i}", prompt_ids=list(p),
                                        params=SamplingParams(max_tokens=max_tokens))
                outs.append([t for chunk in [c async for c in engine.generate(req)] for t in chunk.token_ids])
            return outs
        finally:
            await engine.stop()

    import asyncio

    return asyncio.run(main())


@needs_rounding
@pytest.mark.parametrize("hidden", HIDDEN)
def test_suffix_trees_on_bf16_activations_equal_target_only_decoding(hidden):
    """Repetitive prompts, so that the suffix drafter's trees are accepted in part: every output
    is the target-only engine's on the same activations, token for token."""
    target = _bf16_target(hidden=hidden)
    prompts = [p * 4 for p in PROMPTS]
    plain = _serve(target, 0, prompts)
    spec = _serve(target, 8, prompts + prompts)  # the second round drafts from the first
    assert spec == plain + plain


@needs_rounding
@pytest.mark.parametrize("hidden", HIDDEN)
def test_the_cache_holds_bf16_where_attention_reads_bf16_and_decodes_the_same(hidden, monkeypatch):
    """Where the forward's attention is on bf16 operands (heads of 64 with AVX-512 BF16), the
    engine's KV cache holds bf16, rounded once when written: suffix trees and all, every output
    is token for token what the same forward gives on an fp32 cache. Heads of 16 (fp32
    attention) keep an fp32 cache."""
    target = _bf16_target(hidden=hidden)
    engine = TorchEngine(target, None, EngineConfig(k=0, bf16_activations=True))
    fast = engine.runner.fast
    bf16_cache = fast.bf16_attention
    assert bf16_cache == (hidden == 256 and da.bf16_takes(4, 2, 64))
    assert engine.runner.new_cache(1).dtype == (torch.bfloat16 if bf16_cache else torch.float32)
    prompts = [p * 4 for p in PROMPTS]
    served = _serve(target, 8, prompts + prompts)
    monkeypatch.setattr(fast, "kv_dtype", torch.float32)  # the engines share this forward
    assert engine.runner.new_cache(1).dtype == torch.float32
    assert _serve(target, 8, prompts + prompts) == served


@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("rounded", [False, True], ids=["exact", "bf16-activations"])
@torch.inference_mode()
def test_a_tree_node_gets_the_logits_of_decode_steps_along_its_path(rounded, hidden):
    """Bit for bit, whatever the tree: a node sits at the tree's column and sees its ancestors
    there, yet its logits are those of target-only decode steps along its path (what keeps tree
    speculation token-identical even at a near-tie; on bf16 activations a last-bit difference
    grows to a bf16 step of an activation)."""
    if rounded and not packed_linear.rounding_available():
        pytest.skip("no bf16 dot product (AVX-512 BF16) or AMX on this CPU")
    target = _bf16_target(hidden=hidden)
    forward = shared_forward(target.model, round_activations=rounded)
    g = torch.Generator().manual_seed(1)
    parent = [-1, 0, 0, 1, 1, 2, 3, 3, 6, 4, 8]  # node 10's path: 0, 1, 3, 6, 8, 10
    t, n = len(parent), 29
    depth = [0] * t
    ancestors = torch.zeros(1, t, t, dtype=torch.bool)
    for i in range(t):
        j = i
        while j >= 0:
            ancestors[0, i, j] = True
            j = parent[j]
        depth[i] = int(ancestors[0, i].sum()) - 1
    prompt = torch.randint(0, VOCAB, (1, n), generator=g)
    nodes = torch.randint(0, VOCAB, (1, t), generator=g)

    def prefilled():
        cache = RaggedKVCache.for_model(target.model, batch_size=1)
        forward(prompt, *cache.prepare(n), cache)
        cache.commit([n])
        return cache

    cache = prefilled()
    cache.set_tree(torch.tensor([depth]), ancestors)
    tree = forward(nodes, *cache.prepare(t), cache).logits[0]  # [t, V]
    cache = prefilled()
    for node in (0, 1, 3, 6, 8, 10):
        step = forward(nodes[:, node : node + 1], *cache.prepare(1), cache).logits[0, -1]
        cache.commit([1])
        assert torch.equal(step, tree[node]), f"node {node}"


def test_serving_runs_bf16_activations_by_default_and_the_environment_turns_them_off(monkeypatch):
    """What ``specloop serve`` builds: the served engine asks for bf16 activations unless
    SPECLOOP_BF16_ACTIVATIONS=0 (EngineConfig itself stays exact: the tests' building block)."""
    from serving.builder import build_engine
    from serving.config import ServingSettings

    assert EngineConfig().bf16_activations is False
    target = _bf16_target()
    engine = build_engine(ServingSettings(k=0), target=target)
    assert engine.config.bf16_activations and engine.runner.fast.round_activations
    # what it gets: rounded activations where the CPU multiplies bf16 (elsewhere fp32, reported so)
    assert engine.runner.fast.rounds == (engine.runner.fast.native and packed_linear.rounding_available())
    monkeypatch.setenv("SPECLOOP_BF16_ACTIVATIONS", "0")
    engine = build_engine(ServingSettings(k=0), target=target)
    assert not engine.config.bf16_activations and not engine.runner.fast.round_activations
    assert not engine.runner.fast.rounds
