"""bf16 panels read with rounded activations on the CPU's bf16 dot product
(kernels/native/packed_linear_dot.c) against the float64 product of the roundings."""

from __future__ import annotations

import pytest
import torch

from kernels import packed_linear as pl
from kernels.packed_linear import PackedLinear

needs_dot = pytest.mark.skipif(not pl.dot_available(), reason="no AVX-512 BF16 on this CPU")


def _bf16_valued(*shape, generator) -> torch.Tensor:
    return torch.randn(*shape, generator=generator).bfloat16().float()


def _exact_and_rounded(n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, PackedLinear, PackedLinear]:
    w = _bf16_valued(n, k, generator=g)
    exact = PackedLinear.pack(w, amx=False)
    assert exact.layout == "bf16"
    return w, exact, exact.rounded()


@needs_dot
@pytest.mark.parametrize("tokens", [1, 2, 8, 9, 10, 17, 70])
@pytest.mark.parametrize("n,k", [(960, 576), (577, 584), (49, 1536), (1, 20)])
def test_rounded_activations_are_the_product_of_their_bf16_roundings(tokens, n, k, check_rounded):
    """The same panels (no copy), each activation rounded to bf16 after the prologue, with every
    prologue and a residual; one group, several groups, a padded last panel. The kernel's norm and
    activation agree with torch's to an fp32 ulp or so, which moves the odd activation across a
    bf16 rounding boundary (one bf16 step, 2^-8 of it): looser there."""
    g = torch.Generator().manual_seed(tokens * 31 + n)
    w, exact, rounded = _exact_and_rounded(n, k, g)
    check_rounded(exact, rounded, w, tokens, g, {"rtol": 1e-3, "atol": 1e-2})
    back = rounded.exact()  # the FMA kernel again (what kernels/timed_choice.py times)
    x = torch.randn(tokens, k, generator=g)
    assert back.panels is exact.panels and not back.rounds_activations
    assert torch.equal(back(x), exact(x))


@needs_dot
@pytest.mark.parametrize("tokens", [8, 19, 70])
def test_a_token_gives_the_same_bits_alone_and_among_others(tokens):
    """One chain per output over k in order whatever the token count: a verify and a decode step
    of a forward on rounded activations agree bit for bit (what keeps speculation lossless)."""
    g = torch.Generator().manual_seed(tokens)
    _, _, rounded = _exact_and_rounded(300, 576, g)
    x = torch.randn(tokens, 576, generator=g)
    res = torch.randn(tokens, 300, generator=g)
    norm_w = torch.rand(576, generator=g) + 0.5
    alone = torch.cat([rounded.normed(x[i : i + 1], norm_w, 1e-5, residual=res[i : i + 1])
                       for i in range(tokens)])
    assert torch.equal(rounded.normed(x, norm_w, 1e-5, residual=res), alone)


@needs_dot
def test_the_kernel_refuses_an_odd_width():
    """Pairs of rows: an odd K is refused by the kernel itself (``pack`` never gives one bf16 panels)."""
    lib = pl._load_dot()
    x = torch.zeros(1, 3)
    y = torch.zeros(1, 4)
    w = torch.zeros(64, dtype=torch.bfloat16)
    assert lib.packed_linear_fused_bf16dot(x.data_ptr(), 0, None, 0.0, w.data_ptr(), None, y.data_ptr(),
                                           1, 4, 3, 1) == -1
