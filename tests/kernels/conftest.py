"""Fixtures the kernel tests share."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F


@pytest.fixture
def check_rounded():
    """``check(exact, rounded, w, tokens, generator, prologue_tol)``: ``rounded`` (a PackedLinear
    read with bf16 activations) is ``exact``'s very panels, rounded once, and computes the float64
    product of its bf16-rounded inputs: plain, with a residual, after the RMSNorm and the SwiGLU
    prologues (``prologue_tol``: their tolerances), and not what ``exact`` computes."""

    def check(exact, rounded, w: torch.Tensor, tokens: int, g: torch.Generator, prologue_tol: dict) -> None:
        n, k = w.shape
        assert rounded.panels is exact.panels and rounded.rounds_activations
        assert rounded.rounded() is rounded
        x = torch.randn(tokens, k, generator=g)
        res = torch.randn(tokens, n, generator=g)
        norm_w = torch.rand(k, generator=g) + 0.5
        gu = torch.randn(tokens, 2 * k, generator=g)

        def of_rounding(h):  # the float64 product of the bf16-rounded activations, rounded once
            return (h.bfloat16().double() @ w.double().T).float()

        tight = {"rtol": 1e-5, "atol": 3e-5}
        torch.testing.assert_close(rounded(x), of_rounding(x), **tight)
        torch.testing.assert_close(rounded(x, residual=res), of_rounding(x) + res, **tight)
        torch.testing.assert_close(rounded.normed(x, norm_w, 1e-5),
                                   of_rounding(F.rms_norm(x, (k,), norm_w, 1e-5)), **prologue_tol)
        torch.testing.assert_close(rounded.swiglu(gu, residual=res),
                                   of_rounding(F.silu(gu[:, :k]) * gu[:, k:]) + res, **prologue_tol)
        assert not torch.allclose(rounded(x), exact(x), rtol=1e-6, atol=1e-6)  # it does round

    return check
