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


@needs_native
def test_padded_layout_equals_the_rows_computed_one_by_one():
    """``topk_logprobs_padded`` writes what ``topk_logprobs`` computes for the traced positions
    (ids equal, float16 log-probs bit-equal to numpy's cast of the fp32 ones, subnormal halves of
    near-certain tokens included) and -1 / -inf everywhere else, on one thread and on the pool."""
    import numpy as np

    g = torch.Generator().manual_seed(11)
    r, vocab, t = 40, 4099, 20
    logits = torch.randn(r, vocab, generator=g) * torch.logspace(-0.5, 1.6, r)[:, None]
    logits[:4, 17] = torch.tensor([12.0, 16.0, 20.0, 26.0]) + logits[:4].max(-1).values  # lp ~ -1e-5..-1e-11
    b, k1 = 7, 6
    node_rows = torch.randint(0, r, (b, k1), generator=g).numpy()
    node_rows[0, :4] = [0, 1, 2, 3]
    lengths = np.array([5, 0, 2, 5, 3, 1, 4])
    traced = np.array([True, True, False, True, True, True, False])
    ids, lp = tk.topk_logprobs_padded(logits, t, node_rows, lengths, traced)
    assert ids.shape == lp.shape == (b, k1, t) and ids.dtype == np.int32 and lp.dtype == np.float16
    keep = (np.arange(k1)[None, :] <= lengths[:, None]) & traced[:, None]
    ref_ids, ref_lp = tk.topk_logprobs(logits, t, rows=torch.from_numpy(node_rows[keep].astype(np.int64)))
    assert np.array_equal(ids[keep], ref_ids.numpy())
    want = ref_lp.numpy().astype(np.float16)
    assert np.array_equal(lp[keep].view(np.uint16), want.view(np.uint16))
    assert ((want[:4, 0] != 0) & (np.abs(want[:4, 0]) < 6.1e-5)).any()  # a subnormal half met
    assert (ids[~keep] == -1).all() and np.isneginf(lp[~keep]).all()
    one = tk.topk_logprobs_padded(logits, t, node_rows[:1, :1], lengths[:1], traced[:1])  # caller alone
    assert np.array_equal(one[0][0, 0], ids[0, 0]) and np.array_equal(one[1][0, 0], lp[0, 0])


@needs_native
def test_padded_layout_refuses_a_traced_row_outside_the_logits():
    import numpy as np

    logits = torch.randn(3, 50)
    with pytest.raises(RuntimeError, match="outside"):
        tk.topk_logprobs_padded(logits, 5, np.array([[0, 3]]), np.array([1]), np.array([True]))
    ids, _ = tk.topk_logprobs_padded(logits, 5, np.array([[0, 3]]), np.array([0]), np.array([True]))
    assert (ids[0, 1] == -1).all()  # an untraced slot's row is never read
    with pytest.raises(ValueError, match="must be"):  # never read past the arrays it was given
        tk.topk_logprobs_padded(logits, 5, np.array([[0, 1], [1, 2]]), np.array([1]), np.array([True]))


def test_padded_layout_leaves_other_devices_and_dtypes_to_the_caller():
    import numpy as np

    args = (np.zeros((1, 1), dtype=np.int64), np.zeros(1, dtype=np.int64), np.ones(1, dtype=bool))
    assert tk.topk_logprobs_padded(torch.randn(2, 30, dtype=torch.float64), 4, *args) is None
