"""argmax_rows (native) against torch's argmax of the chosen rows, and the greedy tree verify that
reads only the verified positions."""

import torch

from kernels.argmax_rows import argmax_rows
from kernels.tree_verify import greedy_tree_verify


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


def test_greedy_tree_verify_reads_only_verified_positions_and_agrees():
    g = torch.Generator().manual_seed(1)
    b, n, vocab = 4, 6, 50
    logits = torch.randn(b, n, vocab, generator=g)
    parents = torch.tensor([[-1, 0, 1, 1, 3, 4], [-1, 0, 0, 2, -1, -1], [-1, -1, -1, -1, -1, -1],
                            [-1, 0, 1, 2, 3, 4]])
    lengths = torch.tensor([5, 3, 0, 5])
    target = logits.argmax(-1)
    tokens = torch.zeros(b, n, dtype=torch.long)
    for row in range(b):  # drafts that follow the target along the first branch
        for i in range(1, int(lengths[row]) + 1):
            tokens[row, i] = target[row, parents[row, i]]
    tokens[0, 2] = (target[0, 1] + 1) % vocab  # one rejected sibling in row 0
    tokens[1, 1] = (target[1, 0] + 1) % vocab  # row 1: the first child rejected, the second taken
    full = greedy_tree_verify(tokens, parents, logits)
    logits_padded = logits.clone()
    for row in range(b):  # what a padded row holds past its nodes must not matter
        logits_padded[row, int(lengths[row]) + 1:] = 1e4 * torch.arange(vocab)
    part = greedy_tree_verify(tokens, parents, logits_padded, lengths)
    assert torch.equal(full.num_accepted, part.num_accepted)
    assert torch.equal(full.next_tokens, part.next_tokens) and torch.equal(full.path, part.path)
    assert full.num_accepted.tolist() == [4, 2, 0, 5]
