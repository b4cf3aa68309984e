"""RaggedKVCache.drop_rows and append: every survivor keeps its keys, values and length, and a row
joins or leaves without a copy of the whole cache."""

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


def _single(capacity: int, length: int, seed: int) -> RaggedKVCache:
    """A prefilled batch-1 cache: ``length`` real columns, zeros after them."""
    one = _filled(1, capacity, seed)
    one.lengths = [length]
    for buf in one.keys + one.values:
        buf[:, :, length:] = 0
    return one


@pytest.mark.parametrize("seed", range(6))
def test_rows_join_into_spare_rows_and_keep_everyone_s_contents(seed):
    """Joins and leaves in any order give the buffers a plain concatenation would (rows in order,
    each joiner's columns then zeros to the capacity); once the stores have spare rows, a join
    writes into them: the survivors are not copied (the buffers keep their storage)."""
    rnd = random.Random(seed)
    cache = RaggedKVCache(num_layers=2, num_kv_heads=3, head_dim=4, dtype=torch.float32, device="cpu")
    expect: list[tuple[list[torch.Tensor], list[torch.Tensor], int]] = []  # per row: keys, values, length
    reused = 0
    for event in range(24):
        if expect and rnd.random() < 0.35:
            dropped = {r for r in range(len(expect)) if rnd.random() < 0.4}
            order = cache.drop_rows(dropped)
            expect = [expect[r] for r in order]
        else:
            one = _single(_GROW, rnd.randint(1, _GROW - 1), seed * 100 + event)
            ptr = cache.keys[0].data_ptr() if cache.batch_size else None
            cache.append(one)
            reused += ptr is not None and cache.keys[0].data_ptr() == ptr
            expect.append(([k[0].clone() for k in one.keys], [v[0].clone() for v in one.values], one.lengths[0]))
        assert cache.lengths == [length for _, _, length in expect]
        for row, (keys, values, _) in enumerate(expect):
            for layer in range(2):
                assert torch.equal(cache.keys[layer][row], keys[layer])
                assert torch.equal(cache.values[layer][row], values[layer])
        assert all(b.is_contiguous() and b.shape[0] == len(expect) for b in cache.keys + cache.values)
    assert reused > 0  # joins into spare rows happened


def test_a_joiner_into_a_reused_spare_row_sees_zeros_past_its_columns():
    """A spare row once held a row that left: the joiner's columns past its own are zeros again
    (masked columns still enter attention; stale values there must not)."""
    cache = RaggedKVCache(num_layers=1, num_kv_heads=3, head_dim=4, dtype=torch.float32, device="cpu")
    for seed in range(3):
        cache.append(_single(_GROW, _GROW - 1, seed))  # long rows fill the columns
    cache.drop_rows({2})
    cache.append(_single(_GROW, 5, seed=9))  # into the row that was left behind
    assert torch.count_nonzero(cache.keys[0][2, :, 5:]) == 0
    assert torch.count_nonzero(cache.values[0][2, :, 5:]) == 0


def test_spare_rows_stay_within_twice_the_batch_and_max_rows():
    """A cache for a large max batch holds room for at most twice the rows it runs (a long
    context at max batch 64 must not reserve 64 rows for two requests), and never past
    ``max_rows``."""
    cache = RaggedKVCache(num_layers=1, num_kv_heads=3, head_dim=4, dtype=torch.float32, device="cpu")
    cache.max_rows = 64
    for seed in range(3):
        cache.append(_single(_GROW, 7, seed))
        assert cache.batch_size <= cache._stores[0][0].shape[0] <= 2 * cache.batch_size
    small = RaggedKVCache(num_layers=1, num_kv_heads=3, head_dim=4, dtype=torch.float32, device="cpu")
    small.max_rows = 3
    for seed in range(3):
        small.append(_single(_GROW, 7, seed))
        assert small._stores[0][0].shape[0] <= 3


def test_a_batch_that_emptied_keeps_its_stores_for_the_next_rows():
    """When every row left, the next rows join into the same stores (a view of no rows has a
    data_ptr() of 0: the stores are recognised by their storage)."""
    cache = RaggedKVCache(num_layers=1, num_kv_heads=3, head_dim=4, dtype=torch.float32, device="cpu")
    cache.max_rows = 4
    for seed in range(4):
        cache.append(_single(_GROW, 7, seed))
    storage = cache.keys[0].untyped_storage().data_ptr()
    cache.drop_rows({0, 1, 2, 3})
    assert cache.batch_size == 0
    cache.append(_single(_GROW, 9, seed=5))
    assert cache.keys[0].untyped_storage().data_ptr() == storage
    assert cache.lengths == [9]
