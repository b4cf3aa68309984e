"""move_rows: a tree commit's keys and values moved in every buffer at once, as the gather and
scatter it replaces."""

import pytest
import torch

from kernels import kv_rows


def _buffers(n=6, shape=(2, 3, 16, 8), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(n)]


def _reference(buffers, src, dst):
    out = [b.clone() for b in buffers]
    for b in out:
        flat = b.view(-1, b.shape[-1])
        flat.index_copy_(0, dst, flat.index_select(0, src))
    return out


def test_rows_move_in_every_buffer_even_where_a_source_is_also_a_destination():
    bufs = _buffers()
    # a path's nodes moving down: row 7's content to 5 while row 5's goes to 4 (read before written)
    src = torch.tensor([5, 7, 50, 90])
    dst = torch.tensor([4, 5, 49, 91])
    want = _reference(bufs, src, dst)
    kv_rows.move_rows(bufs, src, dst)
    for got, w in zip(bufs, want):
        assert torch.equal(got, w)


@pytest.mark.skipif(kv_rows.native_lib() is None, reason="native kernels not built here")
def test_bf16_buffers_move_natively_as_fp32_ones_do(monkeypatch):
    """A bf16 KV cache's rows (a forward on bf16 attention) move in the same one call."""
    bufs = [b.to(torch.bfloat16) for b in _buffers()]
    src, dst = torch.tensor([5, 7, 50, 90]), torch.tensor([4, 5, 49, 91])
    want = _reference(bufs, src, dst)
    monkeypatch.setattr(torch.Tensor, "index_copy_", None)  # the torch path would fail here
    kv_rows.move_rows(bufs, src, dst)
    assert all(torch.equal(g, w) for g, w in zip(bufs, want))


def test_the_torch_reference_runs_where_the_native_call_cannot():
    bufs = _buffers(n=2)
    bufs[1] = bufs[1].to(torch.float64)  # buffers of mixed dtypes: the torch path
    src, dst = torch.tensor([3, 8]), torch.tensor([2, 3])
    want = _reference(bufs, src, dst)
    kv_rows.move_rows(bufs, src, dst)
    assert all(torch.equal(g, w) for g, w in zip(bufs, want))


@pytest.mark.skipif(kv_rows.native_lib() is None, reason="native kernels not built here")
def test_a_row_outside_the_buffers_is_refused_and_nothing_moves():
    bufs = _buffers(n=2)
    before = [b.clone() for b in bufs]
    rows = bufs[0].numel() // bufs[0].shape[-1]
    with pytest.raises(ValueError, match="outside"):
        kv_rows.move_rows(bufs, torch.tensor([0, rows]), torch.tensor([1, 2]))
    assert all(torch.equal(b, w) for b, w in zip(bufs, before))
