"""The packed-panel matmul against the torch reference (F.linear)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import native_build
from kernels import packed_linear as pl
from kernels.packed_linear import PackedLinear

needs_native = pytest.mark.skipif(not pl.available(), reason="no C compiler / native build")


@needs_native
@pytest.mark.parametrize("tokens", [1, 2, 3, 5, 8, 9, 16, 23, 70])
@pytest.mark.parametrize("n,k", [(960, 576), (577, 584), (33, 1536), (1, 20)])
def test_matches_f_linear(tokens, n, k):
    """Any token count (several passes over a panel above 8) and widths that leave a padded panel."""
    g = torch.Generator().manual_seed(tokens * 1000 + n)
    x = torch.randn(tokens, k, generator=g)
    w = torch.randn(n, k, generator=g)
    packed = PackedLinear.pack(w)
    y = packed(x)
    assert y.shape == (tokens, n)
    torch.testing.assert_close(y, F.linear(x, w), rtol=1e-5, atol=1e-4)


@needs_native
def test_packing_keeps_the_weight():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(130, 48, generator=g)
    packed = PackedLinear.pack(w)
    assert torch.equal(packed.unpacked(), w)
    width = pl.panel_width()
    assert width in (16, 48) and packed.nbytes == -(-130 // width) * width * 48 * 4


@needs_native
def test_leading_dims_and_noncontiguous_input():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 48, generator=g)
    x = torch.randn(2, 3, 96, generator=g)[..., ::2]  # [2, 3, 48], strided
    torch.testing.assert_close(PackedLinear.pack(w)(x), F.linear(x, w), rtol=1e-5, atol=1e-4)


@needs_native
@pytest.mark.parametrize("tokens", [19, 70])
def test_a_token_does_not_depend_on_its_neighbours(tokens):
    """Each output is one FMA chain over k whatever the token count (one group in one pass; several
    groups in a pass each with AVX-512, else sharing a panel's stream chunk by chunk, and further
    passes above 64 tokens): verify and decode agree bit for bit on the projections."""
    g = torch.Generator().manual_seed(2)
    packed = PackedLinear.pack(torch.randn(300, 576, generator=g))
    x = torch.randn(tokens, 576, generator=g)
    res = torch.randn(tokens, 300, generator=g)
    alone = torch.cat([packed(x[i : i + 1], residual=res[i : i + 1]) for i in range(tokens)])
    assert torch.equal(packed(x, residual=res), alone)


@needs_native
def test_wrong_width_is_refused_and_gradients_take_the_reference():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(16, 8, generator=g)
    packed = PackedLinear.pack(w)
    with pytest.raises(ValueError, match="features"):
        packed(torch.randn(2, 9))
    x = torch.randn(2, 8, generator=g, requires_grad=True)
    y = packed(x)  # needs grad: torch path, and gradients flow to x
    y.sum().backward()
    torch.testing.assert_close(x.grad, w.sum(0).expand(2, 8))


def test_nothing_is_packed_without_the_kernel(monkeypatch):
    monkeypatch.setenv("SPECLOOP_NATIVE_KERNELS", "0")
    monkeypatch.setattr(native_build, "_loaded", {})
    assert PackedLinear.pack(torch.randn(4, 8)) is None
    assert pl.panel_width() == 0 and not pl.available()


def test_only_fp32_cpu_matrices_are_packed():
    assert PackedLinear.pack(torch.randn(4, 8, dtype=torch.float64)) is None
    assert PackedLinear.pack(torch.randn(4, 8, 2)) is None


@needs_native
@pytest.mark.parametrize("tokens", [1, 5, 8, 19])
def test_fused_norm_activation_and_residual_match_torch(tokens):
    """The prologues (Llama's RMSNorm; silu(gate) * up) and the residual add done inside the call
    equal the torch ops they replace, to float rounding; widths that leave a padded panel."""
    g = torch.Generator().manual_seed(tokens)
    n, k = 577, 96
    packed = PackedLinear.pack(w := torch.randn(n, k, generator=g))
    x = torch.randn(2, tokens, k, generator=g)
    res = torch.randn(2, tokens, n, generator=g)
    norm_w = torch.rand(k, generator=g) + 0.5
    torch.testing.assert_close(packed(x, residual=res), F.linear(x, w) + res, rtol=1e-5, atol=1e-4)
    want = F.linear(F.rms_norm(x, (k,), norm_w, 1e-5), w)
    torch.testing.assert_close(packed.normed(x, norm_w, 1e-5), want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(packed.normed(x, norm_w, 1e-5, residual=res), want + res,
                               rtol=1e-5, atol=1e-4)
    gu = torch.randn(2, tokens, 2 * k, generator=g)
    want = F.linear(F.silu(gu[..., :k]) * gu[..., k:], w) + res
    torch.testing.assert_close(packed.swiglu(gu, residual=res), want, rtol=1e-5, atol=1e-4)


@needs_native
def test_fused_calls_refuse_wrong_shapes():
    packed = PackedLinear.pack(torch.randn(16, 8))
    with pytest.raises(ValueError, match="features"):
        packed.normed(torch.randn(2, 8), torch.ones(9), 1e-5)
    with pytest.raises(ValueError, match="2 x 8"):
        packed.swiglu(torch.randn(2, 8))
    with pytest.raises(ValueError, match="residual"):
        packed(torch.randn(2, 8), residual=torch.randn(3, 16))


def _bf16_valued(*shape, generator) -> torch.Tensor:
    """fp32 weights whose values are all exactly bf16 (as the default target's are)."""
    return torch.randn(*shape, generator=generator).bfloat16().float()


@needs_native
@pytest.mark.parametrize("tokens", [1, 3, 6, 7, 8, 9, 10, 13, 16, 19, 70])
@pytest.mark.parametrize("n,k", [(960, 576), (577, 584), (1, 20)])
def test_bf16_panels_give_exactly_the_fp32_panels_results(tokens, n, k):
    """A weight that is exactly bf16 streams as bf16 panels (half the bytes) with results bit for
    bit those of fp32 panels: one group widening in registers, several groups (more than 9 tokens
    with AVX-512, 6 with AVX2) in passes of their own (the build's default layout; the chunked one
    is compared in test_timed_choice.py); with every prologue and a residual."""
    g = torch.Generator().manual_seed(tokens * 7 + n)
    w = _bf16_valued(n, k, generator=g)
    half, full = PackedLinear.pack(w), PackedLinear.pack(w, bf16=False)
    assert half.panels.dtype == torch.bfloat16 and full.panels.dtype == torch.float32
    assert half.nbytes * 2 == full.nbytes and torch.equal(half.unpacked(), w)
    x = torch.randn(tokens, k, generator=g)
    res = torch.randn(tokens, n, generator=g)
    norm_w = torch.rand(k, generator=g) + 0.5
    gu = torch.randn(tokens, 2 * k, generator=g)
    assert torch.equal(half(x), full(x))
    assert torch.equal(half(x, residual=res), full(x, residual=res))
    assert torch.equal(half.normed(x, norm_w, 1e-5), full.normed(x, norm_w, 1e-5))
    assert torch.equal(half.swiglu(gu, residual=res), full.swiglu(gu, residual=res))
    torch.testing.assert_close(half(x), F.linear(x, w), rtol=1e-5, atol=1e-4)


@needs_native
def test_a_weight_that_is_not_exactly_bf16_keeps_fp32_panels():
    g = torch.Generator().manual_seed(9)
    w = _bf16_valued(40, 32, generator=g)
    w[3, 5] += 1e-4  # one value off the bf16 grid
    assert not pl.bf16_exact(w) and pl.bf16_exact(_bf16_valued(4, 4, generator=g))
    packed = PackedLinear.pack(w)
    assert packed.panels.dtype == torch.float32 and torch.equal(packed.unpacked(), w)


needs_amx = pytest.mark.skipif(not pl.amx_available(), reason="no AMX-BF16 on this CPU")


@needs_amx
@pytest.mark.parametrize("tokens", [1, 3, 8, 9, 16, 17, 40])
@pytest.mark.parametrize("n,k", [(960, 576), (577, 64), (32, 1536)])
def test_amx_tiles_match_torch_with_every_prologue_and_a_residual(tokens, n, k):
    """Tiles over the three bf16 parts of each activation: fp32 precision (within F.linear's own
    rounding of the float64 product), at widths below, at and past one 16-token tile, and with a
    last panel padded."""
    g = torch.Generator().manual_seed(tokens * 11 + n)
    w = _bf16_valued(n, k, generator=g)
    packed = PackedLinear.pack(w, amx=True)
    assert packed.layout == "amx" and torch.equal(packed.unpacked(), w)
    x = torch.randn(tokens, k, generator=g)
    res = torch.randn(tokens, n, generator=g)
    norm_w = torch.rand(k, generator=g) + 0.5
    gu = torch.randn(tokens, 2 * k, generator=g)

    def exact(h):  # the float64 product, rounded once
        return (h.double() @ w.double().T).float()

    torch.testing.assert_close(packed(x), exact(x), rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(packed(x, residual=res), exact(x) + res, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(packed.normed(x, norm_w, 1e-5), exact(F.rms_norm(x, (k,), norm_w, 1e-5)),
                               rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(packed.swiglu(gu, residual=res),
                               exact(F.silu(gu[:, :k]) * gu[:, k:]) + res, rtol=1e-5, atol=1e-4)


@needs_amx
def test_amx_a_token_gives_the_same_bits_alone_and_among_others():
    """Verify and decode agree bit for bit on the tiles: a token's outputs do not depend on how
    many tokens share the call (below 8 each thread splits every token itself; above, the threads
    share the split; above 16, tiles of 16 and a padded last one)."""
    g = torch.Generator().manual_seed(5)
    k = 576
    packed = PackedLinear.pack(_bf16_valued(577, k, generator=g), amx=True)
    norm_w = torch.rand(k, generator=g) + 0.5
    x = torch.randn(40, 2 * k, generator=g)
    alone = [packed(x[t : t + 1, :k]) for t in range(40)]
    normed = [packed.normed(x[t : t + 1, :k], norm_w, 1e-5) for t in range(40)]
    swiglu = [packed.swiglu(x[t : t + 1]) for t in range(40)]
    for tokens in (2, 7, 8, 9, 16, 17, 40):
        assert all(torch.equal(row, alone[t][0]) for t, row in enumerate(packed(x[:tokens, :k])))
        together = packed.normed(x[:tokens, :k], norm_w, 1e-5)
        assert all(torch.equal(row, normed[t][0]) for t, row in enumerate(together))
        assert all(torch.equal(row, swiglu[t][0]) for t, row in enumerate(packed.swiglu(x[:tokens])))


@needs_amx
def test_amx_packing_only_where_it_can_run():
    """Tiles take exactly-bf16 weights with K a multiple of 32; anything else keeps its panels."""
    g = torch.Generator().manual_seed(2)
    assert PackedLinear.pack(_bf16_valued(64, 48, generator=g), amx=True).layout == "bf16"
    assert PackedLinear.pack(torch.randn(64, 64, generator=g), amx=True).layout == "fp32"
    assert PackedLinear.pack(_bf16_valued(64, 64, generator=g)).layout == "bf16"  # amx is asked for
    assert PackedLinear.pack(_bf16_valued(64, 64, generator=g), bf16=False, amx=True).layout == "fp32"


@needs_amx
@pytest.mark.parametrize("tokens", [1, 8, 9, 16, 17, 32, 33, 70])
@pytest.mark.parametrize("n,k", [(960, 576), (577, 64)])
def test_amx_rounded_activations_are_the_product_of_their_bf16_roundings(tokens, n, k, check_rounded):
    """``rounded()``: the same panels (no copy) read with each activation (after the prologue)
    rounded to its nearest bf16; one or two 16-token groups at a time, the last one partial."""
    g = torch.Generator().manual_seed(tokens * 13 + n)
    w = _bf16_valued(n, k, generator=g)
    exact = PackedLinear.pack(w, amx=True)
    check_rounded(exact, exact.rounded(), w, tokens, g, {"rtol": 1e-5, "atol": 1e-4})


def test_rounded_is_the_weight_itself_where_nothing_multiplies_bf16(monkeypatch):
    """fp32 and int8 panels, and bf16 panels without a bf16 dot product (``SPECLOOP_BF16_DOT=0``
    stands in for a CPU without one) and off AMX tiles, keep fp32 activations: ``rounded()``
    changes nothing."""
    g = torch.Generator().manual_seed(3)
    monkeypatch.setenv("SPECLOOP_BF16_DOT", "0")
    for packed in (PackedLinear.pack(_bf16_valued(64, 48, generator=g), amx=False),
                   PackedLinear.pack(torch.randn(64, 64, generator=g), amx=True),
                   PackedLinear.pack_int8(torch.randn(64, 64, generator=g))):
        if packed is not None:
            assert packed.rounded() is packed


@needs_native
def test_an_odd_width_keeps_fp32_panels():
    """bf16 panels pair rows k and k+1: a weight with an odd K keeps fp32 panels (exact either way)."""
    w = _bf16_valued(40, 33, generator=torch.Generator().manual_seed(4))
    packed = PackedLinear.pack(w)
    assert packed.layout == "fp32" and torch.equal(packed.unpacked(), w)


@needs_native
@pytest.mark.parametrize("tokens", [1, 3, 9, 10, 19, 70, 80])
@pytest.mark.parametrize("n,k", [(960, 576), (577, 584), (1, 20)])
def test_int8_panels_compute_with_the_weights_they_quantise_to(tokens, n, k):
    """int8 panels (a drafter's): one scale per output row, |q| <= 127, within half a step of the
    weight; every prologue and the residual as with the other layouts; a token's result does not
    depend on how many tokens share the call (chunks and passes included); half of bf16's bytes."""
    g = torch.Generator().manual_seed(tokens * 31 + n)
    w = torch.randn(n, k, generator=g) * 0.05
    w[0, 0] = 0.4  # an outlier sets row 0's scale
    packed = PackedLinear.pack_int8(w)
    assert packed.layout == "int8" and packed.rounded() is packed
    deq = packed.unpacked()  # [N, K] q x s
    step = w.abs().amax(dim=1, keepdim=True) / 127  # [N, 1]
    assert bool(((deq - w).abs() <= step / 2 + 1e-7).all())
    assert torch.allclose(deq / step, (deq / step).round(), atol=1e-3)  # multiples of the scale
    width = pl.panel_width()
    assert packed.nbytes == -(-n // width) * width * (k + 4)

    x = torch.randn(tokens, 2 * k, generator=g)
    res = torch.randn(tokens, n, generator=g)
    norm = torch.rand(k, generator=g) + 0.5
    cases = [
        (packed(x[:, :k]), F.linear(x[:, :k], deq)),
        (packed(x[:, :k], residual=res), F.linear(x[:, :k], deq) + res),
        (packed.normed(x[:, :k], norm, 1e-5), F.linear(F.rms_norm(x[:, :k], (k,), norm, 1e-5), deq)),
        (packed.swiglu(x, residual=res), F.linear(F.silu(x[:, :k]) * x[:, k:], deq) + res),
    ]
    for got, want in cases:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    alone = torch.cat([packed(x[i : i + 1, :k]) for i in range(tokens)])
    assert torch.equal(alone, packed(x[:, :k]))


@needs_native
def test_int8_packing_refuses_what_it_cannot_serve():
    assert PackedLinear.pack_int8(torch.randn(4, 8, dtype=torch.float64)) is None
    assert PackedLinear.pack_int8(torch.randn(8)) is None
    zero = PackedLinear.pack_int8(torch.zeros(3, 16))  # an all-zero row: no division by zero
    assert torch.equal(zero(torch.randn(2, 16)), torch.zeros(2, 3))
