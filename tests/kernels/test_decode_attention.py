"""The native rotary + cache-write + attention kernel against the same steps in torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import decode_attention as da

needs_native = pytest.mark.skipif(not da.available(), reason="no C compiler / native build")


def _rope(x, cos, sin):  # x [B, H, T, D]; cos, sin [B, 1, T, D]
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _reference(qkv, cos, sin, keys, values, cols, mask, hq, hkv, scale, bf16=False):
    """torch's rotary + index_put + SDPA; ``bf16``: the bf16 arithmetic instead (fp32 sums in
    torch's order): queries and keys rounded for the scores, fp32 softmax, numerators and values
    rounded for the weighted sum, normalised after."""
    b, t, _ = qkv.shape
    d = keys.shape[-1]
    q = qkv[..., : hq * d].view(b, t, hq, d).transpose(1, 2)
    k = qkv[..., hq * d : (hq + hkv) * d].view(b, t, hkv, d).transpose(1, 2)
    v = qkv[..., (hq + hkv) * d :].view(b, t, hkv, d).transpose(1, 2)
    q, k = _rope(q, cos[:, None], sin[:, None]), _rope(k, cos[:, None], sin[:, None])
    rows = torch.arange(b)[:, None].expand(-1, t)
    keys[rows, :, cols] = k.transpose(1, 2)
    values[rows, :, cols] = v.transpose(1, 2)
    n = mask.shape[-1]
    if bf16:
        bf = lambda x: x.bfloat16().float()
        kk = keys[:, :, :n].repeat_interleave(hq // hkv, 1)
        vv = values[:, :, :n].repeat_interleave(hq // hkv, 1)
        s = (bf(q) @ bf(kk).transpose(-1, -2) * scale).masked_fill(~mask[:, None], float("-inf"))
        e = torch.exp(s - s.amax(-1, keepdim=True))  # [B, Hq, T, L]
        att = (bf(e) @ bf(vv)) / e.sum(-1, keepdim=True)
        return att.transpose(1, 2).reshape(b, t, hq * d)
    att = F.scaled_dot_product_attention(
        q, keys[:, :, :n], values[:, :, :n], attn_mask=mask[:, None], scale=scale, enable_gqa=True
    )
    return att.transpose(1, 2).reshape(b, t, hq * d)


def _case(b, t, hq, hkv, d, lengths, capacity, seed, tree=False):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(b, t, (hq + 2 * hkv) * d, generator=g)
    pos = torch.tensor(lengths)[:, None] + torch.arange(t)  # [B, T]
    freqs = pos[..., None].float() / (10000 ** (torch.arange(d // 2).float() / (d // 2)))
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().contiguous(), emb.sin().contiguous()
    keys = torch.randn(b, hkv, capacity, d, generator=g)
    values = torch.randn(b, hkv, capacity, d, generator=g)
    cols = pos.clone()
    n = max(lengths) + t
    colsr = torch.arange(n)
    mask = colsr[None, None, :] <= pos[:, :, None]  # [B, T, L]: causal over ragged rows
    if tree:  # node i sees the prefix, itself and node i - 2 (a branching pattern)
        mask = colsr[None, None, :] < torch.tensor(lengths)[:, None, None]
        mask = mask.expand(b, t, n).clone()
        for i in range(t):
            for j in (i, i - 2):
                if j >= 0:
                    mask[torch.arange(b), i, cols[:, j]] = True
    return qkv, cos, sin, keys, values, cols, mask.contiguous()


@needs_native
@pytest.mark.parametrize("t", [1, 2, 5, 8, 17])
@pytest.mark.parametrize("tree", [False, True])
def test_matches_torch_rope_cache_write_and_sdpa(t, tree):
    """Grouped heads (9 query, 3 kv, SmolLM2's shape), ragged rows, chains and tree masks."""
    hq, hkv, d = 9, 3, 64
    args = _case(3, t, hq, hkv, d, [30, 7, 19], 64, seed=t, tree=tree)
    qkv, cos, sin, keys, values, cols, mask = args
    rk, rv = keys.clone(), values.clone()
    ref = _reference(qkv, cos, sin, rk, rv, cols, mask, hq, hkv, 0.125)
    got = da.decode_attention(qkv, cos, sin, keys, values, cols, mask, hq, hkv, 0.125)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(keys, rk, rtol=1e-6, atol=1e-6)  # the same cache written
    assert torch.equal(values, rv)


@needs_native
@pytest.mark.parametrize(("hq", "hkv"), [(7, 1), (4, 2), (8, 8)])
def test_groups_of_any_size(hq, hkv):
    """The kernel attends a kv head's query heads up to 4 at a time: 7 of one kv head take a
    group of 4 and one of 3; 2 per kv head and 1 per kv head (no grouping) take one each."""
    d = 64  # the grouped path needs D to be a multiple of 4 AVX-512 vectors (2 AVX2 ones)
    args = _case(2, 4, hq, hkv, d, [11, 3], 24, seed=hq + hkv)
    qkv, cos, sin, keys, values, cols, mask = args
    rk, rv = keys.clone(), values.clone()
    ref = _reference(qkv, cos, sin, rk, rv, cols, mask, hq, hkv, d**-0.5)
    got = da.decode_attention(qkv, cos, sin, keys, values, cols, mask, hq, hkv, d**-0.5)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@needs_native
def test_odd_head_dim_and_one_kv_head():
    args = _case(2, 3, 4, 1, 20, [5, 0], 16, seed=9)
    qkv, cos, sin, keys, values, cols, mask = args
    rk, rv = keys.clone(), values.clone()
    ref = _reference(qkv, cos, sin, rk, rv, cols, mask, 4, 1, 20**-0.5)
    got = da.decode_attention(qkv, cos, sin, keys, values, cols, mask, 4, 1, 20**-0.5)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@needs_native
def test_bad_columns_are_refused_before_anything_is_written():
    qkv, cos, sin, keys, values, cols, mask = _case(1, 2, 2, 1, 16, [4], 8, seed=3)
    before = keys.clone()
    with pytest.raises(ValueError, match="refused"):
        da.decode_attention(qkv, cos, sin, keys, values, cols + 10, mask, 2, 1, 0.25)
    assert torch.equal(keys, before)
    with pytest.raises(ValueError, match="heads"):
        da.decode_attention(qkv, cos, sin, keys, values, cols, mask, 3, 1, 0.25)
    with pytest.raises(ValueError, match="contiguous"):
        da.decode_attention(qkv, cos, sin, keys, values, cols.int(), mask, 2, 1, 0.25)


@needs_native
@pytest.mark.parametrize("tree", [False, True])
def test_real_tokens_alone_with_their_cache_rows_equal_the_padded_call(tree):
    """A ragged verify's real tokens passed one per row (T = 1) with ``rows`` (their cache row)
    give the padded call's outputs at those tokens, and write the same cache columns."""
    hq, hkv, d = 9, 3, 64
    qkv, cos, sin, keys, values, cols, mask = _case(3, 5, hq, hkv, d, [30, 7, 19], 64, seed=4, tree=tree)
    real = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)  # [B, T]
    pk, pv = keys.clone(), values.clone()
    padded = da.decode_attention(qkv, cos, sin, pk, pv, cols, mask, hq, hkv, 0.125)
    rows = real.nonzero()[:, 0].contiguous()  # [N]: each real token's cache row
    packed = da.decode_attention(
        qkv[real][:, None].contiguous(), cos[real][:, None].contiguous(), sin[real][:, None].contiguous(),
        keys, values, cols[real][:, None].contiguous(), mask[real][:, None].contiguous(), hq, hkv, 0.125,
        rows=rows,
    )  # [N, 1, Hq * D]
    assert torch.equal(packed[:, 0], padded[real])
    written = torch.zeros_like(keys, dtype=torch.bool)
    written[rows, :, cols[real]] = True
    assert torch.equal(keys[written], pk[written]) and torch.equal(values[written], pv[written])
    with pytest.raises(ValueError, match="refused"):
        da.decode_attention(qkv[real][:, None].contiguous(), cos[real][:, None].contiguous(),
                            sin[real][:, None].contiguous(), keys, values,
                            cols[real][:, None].contiguous(), mask[real][:, None].contiguous(),
                            hq, hkv, 0.125, rows=rows + 3)


@needs_native
@pytest.mark.parametrize("t", [2, 5, 8, 17])
@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("d", [16, 64, 80, 128])
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_a_token_gets_the_same_bits_alone_as_among_many(t, tree, d, bf16):
    """A verify of t tokens gives each token the bits that t one-token calls (decode steps, each
    seeing the columns the mask gives it, over a mask no wider than a step's) give it: with
    AVX-512 the kernel scores several tokens of a cache row 16 keys at a time (attention_tiles.h)
    and one token per query head, and both add the same products in the same order; head sizes
    the grouped loop cannot take (16, 80) go one head at a time through the same softmax. Without
    AVX-512 (AVX2) a cache row's tokens share each block of eight keys and each value row
    (attention_segments.h), with the one-token loop's chains. So a speculative step's logits are a
    plain step's. On bf16 operands (heads of 64 and 128) too."""
    if bf16 and not da.bf16_takes(9, 3, d):
        pytest.skip("bf16 operands take heads of 64 and 128 on an AVX-512 BF16 build")
    hq, hkv = 9, 3
    qkv, cos, sin, keys, values, cols, mask = _case(3, t, hq, hkv, d, [30, 7, 19], 64, seed=t + d, tree=tree)
    many_k, many_v = keys.clone(), values.clone()
    many = da.decode_attention(qkv, cos, sin, many_k, many_v, cols, mask, hq, hkv, d**-0.5, bf16=bf16)
    for i in range(t):  # one token at a time, as decode steps would write and read the cache
        step_width = 30 + i + 1  # a decode step's mask reaches its own column, not the verify's last
        one = da.decode_attention(
            qkv[:, i : i + 1].contiguous(), cos[:, i : i + 1].contiguous(), sin[:, i : i + 1].contiguous(),
            keys, values, cols[:, i : i + 1].contiguous(), mask[:, i : i + 1, :step_width].contiguous(),
            hq, hkv, d**-0.5, bf16=bf16,
        )
        assert torch.equal(one[:, 0], many[:, i]), f"token {i}"
    assert torch.equal(keys, many_k) and torch.equal(values, many_v)


@needs_native
@pytest.mark.parametrize("t", [3, 7, 12])
@pytest.mark.parametrize("n", [36, 37])
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_a_tree_node_gets_the_bits_of_decode_steps_along_its_path(t, n, bf16):
    """A token tree's node sits at the tree's column, sees the prefix and its ancestors there, and
    still gets the bits that decode steps along its path give it once the path is committed to
    consecutive columns (the softmax's sum packs the visible keys first; on bf16 operands the
    values pair by visible index), after an even or an odd prefix: so a tree verify cannot flip a
    near-tie that target-only decoding would resolve the other way."""
    if bf16 and not da.bf16_takes(9, 3, 64):
        pytest.skip("no AVX-512 BF16 build")
    hq, hkv, d = 9, 3, 64
    g = torch.Generator().manual_seed(t + n)
    parent = [-1] + [(i - 1) // 2 for i in range(1, t)]  # a binary tree, nodes in level order
    depth = [0] * t
    for i in range(1, t):
        depth[i] = depth[parent[i]] + 1
    qkv = torch.randn(1, t, (hq + 2 * hkv) * d, generator=g)
    prefix_k = torch.randn(1, hkv, 64, d, generator=g)
    prefix_v = torch.randn(1, hkv, 64, d, generator=g)

    def rotary(positions):  # cos, sin [1, q, D] at these positions
        freqs = torch.tensor(positions)[:, None].float() / (10000 ** (torch.arange(d // 2).float() / (d // 2)))
        emb = torch.cat([freqs, freqs], dim=-1)[None]
        return emb.cos().contiguous(), emb.sin().contiguous()

    cos, sin = rotary([n + dep for dep in depth])
    mask = torch.zeros(1, t, n + t, dtype=torch.bool)
    mask[:, :, :n] = True
    for i in range(t):
        j = i
        while j >= 0:
            mask[0, i, n + j] = True
            j = parent[j]
    keys, values = prefix_k.clone(), prefix_v.clone()
    cols = (n + torch.arange(t))[None]
    tree = da.decode_attention(qkv, cos, sin, keys, values, cols, mask, hq, hkv, d**-0.5, bf16=bf16)
    for leaf in (t - 1, t - 2):
        path, j = [], leaf
        while j >= 0:
            path.append(j)
            j = parent[j]
        keys, values = prefix_k.clone(), prefix_v.clone()
        for step, node in enumerate(reversed(path)):  # decode steps along the path, at consecutive columns
            c, s = rotary([n + step])
            one = da.decode_attention(
                qkv[:, node : node + 1].contiguous(), c, s, keys, values, torch.tensor([[n + step]]),
                (torch.arange(n + step + 1) <= n + step)[None, None].contiguous(), hq, hkv, d**-0.5,
                bf16=bf16,
            )
            assert torch.equal(one[:, 0], tree[:, node]), f"node {node} at depth {step}"


needs_bf16 = pytest.mark.skipif(not (da.available() and da.bf16_takes(9, 3, 64)),
                                reason="no AVX-512 BF16 build")


@needs_bf16
@pytest.mark.parametrize("t", [1, 2, 5, 8, 17])
@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_bf16_operands_are_the_rounded_arithmetic(t, tree, d):
    """bf16=True computes the attention of a forward on bf16 activations: the torch reference of
    that arithmetic to fp32 summation order, and not the fp32 attention (it does round)."""
    hq, hkv = 9, 3
    qkv, cos, sin, keys, values, cols, mask = _case(3, t, hq, hkv, d, [30, 7, 19], 64, seed=t + d, tree=tree)
    k32, v32 = keys.clone(), values.clone()
    want = _reference(qkv, cos, sin, keys.clone(), values.clone(), cols, mask, hq, hkv, d**-0.5, bf16=True)
    got = da.decode_attention(qkv, cos, sin, keys, values, cols, mask, hq, hkv, d**-0.5, bf16=True)
    # another order of fp32 sums can round a numerator to the neighbouring bf16 value (2^-9)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-3)
    exact = da.decode_attention(qkv, cos, sin, k32, v32, cols, mask, hq, hkv, d**-0.5)
    torch.testing.assert_close(got, exact, rtol=0, atol=0.05)  # bf16 operands: ~1e-2 at most
    assert (got - want).abs().mean() < (got - exact).abs().mean() / 10  # and it is not fp32's


@needs_bf16
@pytest.mark.parametrize("t", [3, 9, 12])
def test_bf16_any_mask_is_the_rounded_arithmetic(t):
    """Masks with holes anywhere (column 0 hidden, gaps in the committed prefix, rows of one tile
    that share no prefix at all) and NaN in the columns no query sees: bf16=True is still the
    reference's rounded arithmetic. The value pass sums the columns every row of a tile sees in
    shared passes and each mask's own columns after them; this checks where those meet."""
    hq, hkv, d = 9, 3, 64
    qkv, cos, sin, keys, values, cols, mask = _case(2, t, hq, hkv, d, [40, 21], 64, seed=t)
    g = torch.Generator().manual_seed(100 + t)
    mask = mask & (torch.rand(mask.shape, generator=g) < 0.7)
    b_idx = torch.arange(2)[:, None].expand(-1, t)
    mask[b_idx, torch.arange(t)[None, :].expand(2, -1), cols] = True  # a token always sees itself
    unseen = ~mask.any(dim=1)  # [B, L]: columns no token of the row sees
    want = _reference(qkv, cos, sin, keys.clone(), values.clone(), cols, mask, hq, hkv, d**-0.5, bf16=True)
    dirty_k, dirty_v = keys.clone(), values.clone()
    for b in range(2):
        hidden = unseen[b].nonzero()[:, 0]
        hidden = hidden[~torch.isin(hidden, cols[b])]
        dirty_k[b, :, hidden] = float("nan")
        dirty_v[b, :, hidden] = float("nan")
    got = da.decode_attention(qkv, cos, sin, dirty_k, dirty_v, cols, mask, hq, hkv, d**-0.5, bf16=True)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-3)


@needs_bf16
@pytest.mark.parametrize("t", [1, 5, 9, 17])
@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_a_bf16_cache_gives_the_bits_of_an_fp32_one(t, tree, d):
    """On bf16 operands the tiles round what they read of the cache to bf16, so a cache that holds
    bf16 (rounded once, when the kernel writes this call's keys and values) gives the same output
    bits as an fp32 cache, and afterwards holds exactly the fp32 cache's values rounded, the new
    keys after rotary included."""
    hq, hkv = 9, 3
    qkv, cos, sin, keys, values, cols, mask = _case(3, t, hq, hkv, d, [30, 7, 19], 64, seed=t + d, tree=tree)
    k16, v16 = keys.to(torch.bfloat16), values.to(torch.bfloat16)
    want = da.decode_attention(qkv, cos, sin, keys, values, cols, mask, hq, hkv, d**-0.5, bf16=True)
    got = da.decode_attention(qkv, cos, sin, k16, v16, cols, mask, hq, hkv, d**-0.5, bf16=True)
    assert torch.equal(got, want)
    assert torch.equal(k16, keys.to(torch.bfloat16)) and torch.equal(v16, values.to(torch.bfloat16))


@needs_native
def test_a_bf16_cache_is_refused_for_fp32_operands_or_mixed_with_fp32():
    """Only a forward on bf16 operands reads a bf16 cache (fp32 attention would compute on values
    it never had), and keys and values come in one dtype."""
    qkv, cos, sin, keys, values, cols, mask = _case(1, 2, 9, 3, 64, [5], 16, seed=0)
    with pytest.raises(ValueError, match="bf16"):
        da.decode_attention(qkv, cos, sin, keys.bfloat16(), values.bfloat16(), cols, mask, 9, 3, 0.125)
    with pytest.raises(ValueError, match="bf16"):
        da.decode_attention(qkv, cos, sin, keys.bfloat16(), values, cols, mask, 9, 3, 0.125, bf16=True)


@needs_native
@pytest.mark.parametrize("t", [1, 4])
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_columns_nobody_sees_cannot_leak_into_the_output(t, bf16):
    """A cache column no query sees may hold anything (NaN here): it enters as nothing, in the
    one-token loop and where a cache row's tokens share their keys (tiles, segments)."""
    if bf16 and not da.bf16_takes(9, 3, 64):
        pytest.skip("no AVX-512 BF16 build")
    hq, hkv, d = 9, 3, 64
    qkv, cos, sin, keys, values, cols, mask = _case(2, t, hq, hkv, d, [20, 9], 64, seed=5)
    clean = da.decode_attention(qkv, cos, sin, keys.clone(), values.clone(), cols, mask, hq, hkv, d**-0.5,
                                bf16=bf16)
    dirty_k, dirty_v = keys.clone(), values.clone()
    dirty_k[1, :, 9:20] = float("nan")  # row 1's columns past its length, below row 0's
    dirty_v[1, :, 9:20] = float("nan")
    dirty = da.decode_attention(qkv, cos, sin, dirty_k, dirty_v, cols, mask, hq, hkv, d**-0.5, bf16=bf16)
    assert torch.equal(clean, dirty)


@needs_native
def test_bf16_is_refused_where_the_tiles_cannot_take_the_heads():
    qkv, cos, sin, keys, values, cols, mask = _case(1, 2, 2, 1, 16, [5], 16, seed=0)
    assert not da.bf16_takes(2, 1, 16)
    with pytest.raises(ValueError, match="bf16"):
        da.decode_attention(qkv, cos, sin, keys, values, cols, mask, 2, 1, 0.25, bf16=True)
