"""RaggedKVCache.drop_rows: every survivor keeps its keys, values and length, without a copy of
the whole cache."""

import random

import pytest
import torch

from serving.engine.batch_cache import _GROW, RaggedKVCache


def _filled(batch: int, capacity: int, seed: int) -> RaggedKVCache:
    g = torch.Generator().manual_seed(seed)
    cache = RaggedKVCache(num_layers=2, num_kv_heads=3, head_dim=4, dtype=torch.float32, device="cpu",
                          batch_size=batch)
    cache.keys = [torch.randn(batch, 3, capacity, 4, generator=g) for _ in range(2)]
    cache.values = [torch.randn(batch, 3, capacity, 4, generator=g) for _ in range(2)]
    cache.capacity = capacity
    cache.lengths = [int(x) for x in torch.randint(1, capacity, (batch,), generator=g)]
    return cache


@pytest.mark.parametrize("seed", range(12))
def test_drop_rows_keeps_each_survivors_keys_values_and_length(seed):
    rnd = random.Random(seed)
    batch = rnd.randint(1, 9)
    dropped = {r for r in range(batch) if rnd.random() < 0.45}
    cache = _filled(batch, _GROW, seed)
    before = ([k.clone() for k in cache.keys], [v.clone() for v in cache.values], list(cache.lengths))
    order = cache.drop_rows(dropped)
    assert sorted(order) == [r for r in range(batch) if r not in dropped]
    assert cache.batch_size == len(order) == len(cache.lengths)
    for new, old in enumerate(order):
        assert cache.lengths[new] == before[2][old]
        for layer in range(2):
            assert torch.equal(cache.keys[layer][new], before[0][layer][old])
            assert torch.equal(cache.values[layer][new], before[1][layer][old])
    assert all(k.is_contiguous() and k.shape[0] == len(order) for k in cache.keys + cache.values)


def test_drop_rows_shrinks_a_far_too_large_capacity():
    cache = _filled(3, 4 * _GROW, seed=1)
    cache.lengths = [10, 4 * _GROW - 1, 20]
    kept = cache.drop_rows({1})
    assert sorted(kept) == [0, 2] and cache.capacity == _GROW
    assert all(k.shape[2] == _GROW and k.is_contiguous() for k in cache.keys + cache.values)
