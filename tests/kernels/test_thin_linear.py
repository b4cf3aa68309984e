"""The native thin-token matmul against the torch reference (F.linear)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import native_build
from kernels import thin_linear as tl

needs_native = pytest.mark.skipif(not tl.available(), reason="no C compiler / native build")


@needs_native
@pytest.mark.parametrize("tokens", [1, 2, 3, 5, 8, 9, 16, 23])
@pytest.mark.parametrize("n,k", [(960, 576), (577, 584), (33, 1536), (1, 20)])
def test_matches_f_linear(tokens, n, k):
    g = torch.Generator().manual_seed(tokens * 1000 + n)
    x = torch.randn(tokens, k, generator=g)
    w = torch.randn(n, k, generator=g)
    y = tl.thin_linear(x, w)
    assert y.shape == (tokens, n)
    torch.testing.assert_close(y, F.linear(x, w), rtol=1e-5, atol=1e-4)


@needs_native
@pytest.mark.parametrize("tokens", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("n,k", [(960, 576), (577, 584), (1, 20)])
def test_bf16_weights_match_their_fp32_widening(tokens, n, k):
    """bf16 weights are widened exactly in registers: the result is the fp32 product with w.float()."""
    g = torch.Generator().manual_seed(tokens * 7 + n)
    x = torch.randn(tokens, k, generator=g)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    y = tl.thin_linear(x, w)
    assert y.dtype == torch.float32 and y.shape == (tokens, n)
    torch.testing.assert_close(y, F.linear(x, w.float()), rtol=1e-5, atol=1e-4)


def test_bf16_weights_fall_back_to_the_widened_reference(monkeypatch):
    monkeypatch.setenv("SPECLOOP_NATIVE_KERNELS", "0")
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 40, generator=g)
    w = torch.randn(24, 40, generator=g).to(torch.bfloat16)
    torch.testing.assert_close(tl.thin_linear(x, w), F.linear(x, w.float()))


@needs_native
def test_leading_dims_and_noncontiguous_input():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 48, generator=g)
    x = torch.randn(2, 3, 96, generator=g)[..., ::2]  # [2, 3, 48], strided
    torch.testing.assert_close(tl.thin_linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)


@needs_native
def test_a_token_does_not_depend_on_its_neighbours():
    """Each output is summed in the same order whatever the token count: verify and decode agree
    bit for bit on the projections."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(300, 576, generator=g)
    x = torch.randn(7, 576, generator=g)
    alone = torch.cat([tl.thin_linear(x[i : i + 1], w) for i in range(7)])
    assert torch.equal(tl.thin_linear(x, w), alone)


def test_falls_back_where_the_kernel_does_not_apply():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(16, 8, generator=g, dtype=torch.float64)
    x = torch.randn(2, 8, generator=g, dtype=torch.float64)
    torch.testing.assert_close(tl.thin_linear(x, w), F.linear(x, w))  # fp64: torch path
    w32 = torch.randn(16, 8, generator=g, requires_grad=True)
    x32 = torch.randn(2, 8, generator=g)
    y = tl.thin_linear(x32, w32)  # needs grad: torch path, and gradients flow
    y.sum().backward()
    assert w32.grad is not None
    big = torch.randn(tl.MAX_TOKENS + 1, 8, generator=g)
    torch.testing.assert_close(tl.thin_linear(big, w32.detach()), F.linear(big, w32.detach()))


def test_build_is_cached(tmp_path, monkeypatch):
    """A second process finds the built kernel in the cache instead of compiling again."""
    cc = native_build.compiler()
    if cc is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("SPECLOOP_KERNEL_CACHE", str(tmp_path))
    first = native_build.build("thin_linear", cc)
    assert first.exists() and first.parent == tmp_path
    mtime = first.stat().st_mtime_ns
    assert native_build.build("thin_linear", cc) == first and first.stat().st_mtime_ns == mtime
