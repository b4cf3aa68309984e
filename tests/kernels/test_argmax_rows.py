"""argmax_rows (native) against torch's argmax of the chosen rows."""

import torch

from kernels.argmax_rows import argmax_rows


def test_matches_torch_on_chosen_rows_ties_included():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 1003, generator=g)
    x[3, 17] = x[3, 900] = 50.0  # a tie: the first index wins, as in torch
    x[5, -1] = 40.0  # the maximum in the tail after the last full vector
    rows = torch.tensor([3, 0, 5, 11, 3])
    assert torch.equal(argmax_rows(x, rows), x[rows].argmax(-1))
    assert argmax_rows(x, torch.tensor([3]))[0] == 17
    assert argmax_rows(x, torch.zeros(0, dtype=torch.long)).shape == (0,)


def test_rows_outside_are_refused():
    x = torch.randn(4, 64)
    try:
        argmax_rows(x, torch.tensor([4]))
    except (ValueError, IndexError):
        return
    raise AssertionError("a row outside x was read")
