"""The prefix cache: prompts that start like an earlier one reuse its keys and values, bit for bit
what a full prefill computes, and the engine's outputs do not change."""

from __future__ import annotations

import pytest
import torch

from serving.engine.base import GenerationRequest, SamplingParams
from serving.engine.config import EngineConfig
from serving.engine.model_runner import ModelRunner
from serving.engine.prefix_cache import PrefixCache
from serving.engine.reference import target_greedy_reference
from serving.engine.torch_engine import TorchEngine

SHARED = [(7 * i + 3) % 101 for i in range(37)]  # a "system prompt" of 37 tokens: four full blocks of 8


def _kv(layers, n, fill):
    return [torch.full((2, n, 4), float(fill)) for _ in range(layers)]  # [H, n, D]


def test_a_prompt_reuses_the_longest_run_of_cached_blocks_from_its_start():
    cache = PrefixCache(block=4, max_tokens=64)
    tokens = list(range(10))
    keys = [torch.arange(2 * 10 * 4, dtype=torch.float32).view(2, 10, 4) + 100 * layer for layer in range(3)]
    cache.insert(tokens, keys, [k + 0.5 for k in keys])
    assert len(cache) == 2  # blocks [0, 4) and [4, 8); the last 2 tokens are no full block
    n, k, v = cache.lookup(list(range(9)) + [55])
    assert n == 8 and len(k) == 3
    for layer in range(3):
        assert torch.equal(k[layer], keys[layer][:, :8]) and torch.equal(v[layer], keys[layer][:, :8] + 0.5)
    assert cache.lookup([0, 1, 2, 3, 9, 9, 9, 9])[0] == 4  # the second block is keyed by the whole prefix
    assert cache.lookup([1, 2, 3, 4])[0] == 0
    assert cache.lookup([0, 1, 2])[0] == 0  # no full block


def test_the_least_recently_used_blocks_go_first_and_a_prefix_outlives_its_continuations():
    cache = PrefixCache(block=2, max_tokens=6)  # 3 blocks
    cache.insert([1, 2, 3, 4], _kv(1, 4, 1), _kv(1, 4, 1))  # blocks (1 2), (1 2 3 4)
    cache.insert([5, 6], _kv(1, 2, 2), _kv(1, 2, 2))
    cache.lookup([1, 2, 3, 4])  # refreshed: (1 2) now the most recent
    cache.insert([7, 8], _kv(1, 2, 3), _kv(1, 2, 3))  # evicts (5 6)
    assert cache.lookup([5, 6])[0] == 0
    assert cache.lookup([1, 2, 3, 4])[0] == 4
    cache.insert([9, 9, 9, 9], _kv(1, 4, 4), _kv(1, 4, 4))  # two blocks: (7 8) then (1 2 3 4) go
    assert cache.lookup([1, 2, 3, 4])[0] == 2  # the prefix's first block outlived its second
    with pytest.raises(ValueError):
        PrefixCache(block=16, max_tokens=8)


def test_a_prefill_from_cached_blocks_is_bit_for_bit_a_full_prefill(ids_target):
    cached = ModelRunner(ids_target.model, ids_target.device, prefix_cache_tokens=256)
    plain = ModelRunner(ids_target.model, ids_target.device)
    assert cached.fast is not None  # the fast forward (its kernels' row-invariance is the point)
    first, second = SHARED + [5, 6, 7], SHARED + [9, 10, 11, 12, 13, 14]
    with torch.inference_mode():
        cached.prefill(first)
        assert cached.prefix_cache.hit_tokens == 0
        reused, _ = cached.prefill(second)
        full, _ = plain.prefill(second)
    assert cached.prefix_cache.hit_tokens == 32  # four blocks of 8
    assert reused.lengths == full.lengths == [len(second) - 1]
    n = len(second) - 1
    for layer in range(reused.num_layers):
        assert torch.equal(reused.keys[layer][:, :, :n], full.keys[layer][:, :, :n])
        assert torch.equal(reused.values[layer][:, :, :n], full.values[layer][:, :, :n])


def test_the_engine_serves_the_same_tokens_with_the_prefix_cache(ids_target, run, drafters):
    prompts = [SHARED + [i, i + 1, i + 2] for i in range(4)] + [SHARED[:20] + [50, 51]]
    expected = {tuple(p): target_greedy_reference(ids_target.model, p, 24) for p in prompts}
    engine = TorchEngine(ids_target, drafters.Garbage(vocab=101, seed=2),
                         EngineConfig(k=3, max_batch_size=2, prefix_cache_tokens=512))
    reqs = [GenerationRequest(f"p{i}", list(p), SamplingParams(max_tokens=24)) for i, p in enumerate(prompts)]
    outs = run(engine, reqs, delays=[0.0, 0.05, 0.1, 0.15, 0.2])
    for p, chunks in zip(prompts, outs):
        assert [t for c in chunks for t in c.token_ids] == expected[tuple(p)]
    assert engine.runner.prefix_cache.hit_tokens >= 32 * 3  # every later prompt reused the shared blocks


def test_the_hits_are_exported_for_prometheus(ids_target):
    from prometheus_client import CollectorRegistry

    from serving.builder import build_engine
    from serving.config import ServingSettings

    registry = CollectorRegistry()
    engine = build_engine(ServingSettings(k=0, trace_sink="none"), target=ids_target, registry=registry)
    cache = engine.runner.prefix_cache
    other = PrefixCache()
    from serving.metrics import watch_prefix_cache

    watch_prefix_cache(other, registry)  # a second engine on the same registry: summed
    with torch.inference_mode():
        engine.runner.prefill(SHARED + [1, 2])
        engine.runner.prefill(SHARED + [3, 4])
    other.hit_tokens, other.prefilled_tokens = 8, 2
    assert registry.get_sample_value("specloop_prefix_cache_hit_tokens_total") == cache.hit_tokens + 8 == 40
    assert registry.get_sample_value("specloop_prefix_cache_prefilled_tokens_total") == cache.prefilled_tokens + 2
    off = build_engine(ServingSettings(k=0, trace_sink="none", prefix_cache_tokens=0), target=ids_target,
                       registry=CollectorRegistry())
    assert off.runner.prefix_cache is None
