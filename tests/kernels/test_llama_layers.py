"""The native layer loop against the same kernels called one at a time from Python."""

from __future__ import annotations

import pytest
import torch

from kernels import decode_attention as da
from kernels import llama_layers
from kernels.llama_layers import LayerStack
from kernels.packed_linear import PackedLinear

needs_native = pytest.mark.skipif(not llama_layers.available(), reason="no C compiler / native build")

H, HQ, HKV, D, INTER, LAYERS = 64, 4, 2, 16, 96, 3


def _layers(seed: int = 0):
    g = torch.Generator().manual_seed(seed)

    def w(n, k):
        return PackedLinear.pack((torch.randn(n, k, generator=g) / k**0.5).bfloat16().float())

    return [
        (1 + 0.1 * torch.randn(H, generator=g), w((HQ + 2 * HKV) * D, H), w(H, HQ * D),
         1 + 0.1 * torch.randn(H, generator=g), w(2 * INTER, H), w(H, INTER))
        for _ in range(LAYERS)
    ]


def _inputs(b: int, t: int, length: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(b, t, H, generator=g)
    pos = length + torch.arange(t)[None, :].expand(b, t)  # [B, T]
    ang = pos[..., None].float() / (100 ** (torch.arange(D // 2).float() / (D // 2)))
    emb = torch.cat([ang, ang], -1)
    cols = pos.contiguous()
    mask = torch.arange(length + t)[None, None, :] <= pos[:, :, None]  # [B, T, L]
    keys = [torch.randn(b, HKV, 64, D, generator=g) for _ in range(LAYERS)]
    values = [torch.randn(b, HKV, 64, D, generator=g) for _ in range(LAYERS)]
    return h, emb.cos().contiguous(), emb.sin().contiguous(), cols, mask.contiguous(), keys, values


def _one_call_at_a_time(layers, h, cos, sin, cols, mask, keys, values):
    hidden = {}
    for i, (ln1, qkv_w, o_w, ln2, gu_w, down_w) in enumerate(layers):
        qkv = qkv_w.normed(h, ln1, 1e-5)
        att = da.decode_attention(qkv, cos, sin, keys[i], values[i], cols, mask, HQ, HKV, D**-0.5)
        h = o_w(att, residual=h)
        h = down_w.swiglu(gu_w.normed(h, ln2, 1e-5), residual=h)
        hidden[i + 1] = h
    return h, hidden


def _stack(layers):
    stack = LayerStack.build(layers, heads=HQ, kv_heads=HKV, head_dim=D, eps=1e-5, scale=D**-0.5)
    assert stack is not None
    return stack


@needs_native
@pytest.mark.parametrize("b,t", [(1, 1), (2, 3), (1, 9), (3, 17)])
@torch.inference_mode()
def test_one_native_call_computes_what_the_calls_one_by_one_do(b, t):
    layers = _layers()
    h, cos, sin, cols, mask, keys, values = _inputs(b, t, length=7)
    keys2, values2 = [k.clone() for k in keys], [v.clone() for v in values]
    want, hidden = _one_call_at_a_time(layers, h, cos, sin, cols, mask, keys2, values2)
    got, caught = _stack(layers)(h, cos, sin, cols, mask, keys, values, hidden_layers=frozenset({0, 1, 2, 3}))
    assert got.shape == h.shape and torch.equal(got, want)
    assert sorted(caught) == [1, 2]  # 0 is the input and 3 the output: the caller has them
    for i, state in caught.items():
        assert torch.equal(state, hidden[i])
    for x, y in zip(keys + values, keys2 + values2):
        assert torch.equal(x, y)


@needs_native
@torch.inference_mode()
def test_bad_arguments_are_refused_before_anything_is_trusted():
    layers = _layers()
    stack = _stack(layers)
    h, cos, sin, cols, mask, keys, values = _inputs(2, 2, length=5)
    with pytest.raises(ValueError, match="layer 0 refused"):
        stack(h, cos, sin, cols + 100, mask, keys, values)  # columns past the mask's length
    with pytest.raises(ValueError, match="tokens of"):
        stack(h[:, :1], cos, sin, cols, mask, keys, values)
    with pytest.raises(ValueError):
        stack(h, cos, sin, cols, mask.float(), keys, values)


@needs_native
def test_a_stack_is_only_built_where_every_projection_is_packed():
    layers = _layers()
    ln1, qkv, o, ln2, gu, down = layers[1]
    layers[1] = (ln1, qkv, o.unpacked(), ln2, gu, down)
    assert LayerStack.build(layers, heads=HQ, kv_heads=HKV, head_dim=D, eps=1e-5, scale=D**-0.5) is None
