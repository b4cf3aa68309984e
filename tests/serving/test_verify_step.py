"""The verify step's greedy targets: the target's argmax read at verified positions only, from the
forward's logits as they are (padded, or only the real inputs' rows)."""

import torch

from kernels.tree_verify import greedy_tree_verify, tree_accept
from serving.engine.forward_output import ForwardOutput
from serving.engine.verify_step import greedy_targets


def test_greedy_targets_read_only_verified_positions_and_agree():
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
    real = torch.arange(n)[None, :] <= lengths[:, None]  # [B, N]
    for out in (ForwardOutput(logits_padded), ForwardOutput(real=real, real_logits=logits[real])):
        part = tree_accept(tokens, parents, greedy_targets(out, lengths))
        assert torch.equal(full.num_accepted, part.num_accepted)
        assert torch.equal(full.next_tokens, part.next_tokens) and torch.equal(full.path, part.path)
    assert full.num_accepted.tolist() == [4, 2, 0, 5]
    only = torch.tensor([True, False, True, True])  # rows left out get no argmax at all
    assert greedy_targets(ForwardOutput(logits), lengths, only=only)[1].eq(0).all()
