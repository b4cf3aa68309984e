"""The native top-k + log-probs of trace capture against the torch reference."""

from __future__ import annotations

import pytest
import torch

from kernels import topk_logprobs as tk

needs_native = pytest.mark.skipif(not tk.available(), reason="no C compiler / native build")


@needs_native
@pytest.mark.parametrize("n,vocab,t", [(20, 49152, 20), (1, 97, 5), (3, 33, 33), (7, 1000, 1)])
@pytest.mark.parametrize("scale", [0.5, 8.0, 40.0])
def test_matches_the_reference(n, vocab, t, scale):
    g = torch.Generator().manual_seed(n * vocab + t)
    x = torch.randn(n, vocab, generator=g) * scale
    ids, lp = tk.topk_logprobs(x, t)
    ref_ids, ref_lp = tk.topk_logprobs_reference(x, t)
    assert ids.shape == (n, t) and ids.dtype == torch.long
    assert torch.equal(ids, ref_ids)  # distinct random logits: no ties, same order
    torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5)


@needs_native
def test_extreme_logits_and_ties():
    x = torch.full((2, 300), -1e4)
    x[0, 7] = 50.0  # one certain token: its log-prob is ~0, the rest far below
    x[1, :] = 0.0  # all tied: uniform, log-prob -log(300) for any ids chosen
    ids, lp = tk.topk_logprobs(x, 3)
    assert ids[0, 0] == 7 and abs(float(lp[0, 0])) < 1e-6
    torch.testing.assert_close(lp[1], torch.full((3,), -float(torch.log(torch.tensor(300.0)))))
    assert len(set(ids[1].tolist())) == 3


def test_other_inputs_take_the_reference():
    x = torch.randn(4, 50, dtype=torch.float64)
    ids, lp = tk.topk_logprobs(x, 4)
    ref_ids, ref_lp = tk.topk_logprobs_reference(x, 4)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(lp, ref_lp)


def test_chosen_rows_read_in_place_equal_the_rows_copied():
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(9, 3001, generator=g)
    rows = torch.tensor([8, 0, 3, 3])
    ids, lp = tk.topk_logprobs(logits, 5, rows=rows)
    ref_ids, ref_lp = tk.topk_logprobs(logits[rows].contiguous(), 5)
    assert torch.equal(ids, ref_ids) and torch.equal(lp, ref_lp)
    with pytest.raises((RuntimeError, IndexError)):
        tk.topk_logprobs(logits, 5, rows=torch.tensor([9]))
