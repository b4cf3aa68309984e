"""The native tree walks against the torch reference: greedy_tree_walk (argmax fused with the accept
walk) against tree_accept over the argmax of every node, sampled_tree_walk against
sampled_tree_verify: random trees and chains, rejected siblings, ties, padding, batches that wake the
kernel's workers."""

import pytest
import torch

from kernels.argmax_rows import native_lib
from kernels.tree_verify import greedy_tree_walk, tree_accept

pytestmark = pytest.mark.skipif(native_lib() is None, reason="the native kernels do not build here")


def random_case(g: torch.Generator, b: int, n: int, vocab: int, follow: float):
    """Random trees whose drafts follow the target's argmax with probability ``follow``, with
    padding nodes past each row's length and logits laid out as the forward returns them when it
    skips padding (the real nodes' rows only)."""
    logits = torch.randn(b, n, vocab, generator=g)
    logits[0, 0, :3] = 10.0  # a three-way tie: the first maximum wins, as torch's argmax
    target = logits.argmax(-1)  # [B, N]
    lengths = torch.randint(0, n, (b,), generator=g)
    parents = torch.full((b, n), -1, dtype=torch.long)
    tokens = torch.zeros(b, n, dtype=torch.long)
    for row in range(b):
        for i in range(1, int(lengths[row]) + 1):
            p = int(torch.randint(0, i, (1,), generator=g))
            parents[row, i] = p
            hit = float(torch.rand(1, generator=g)) < follow
            tokens[row, i] = target[row, p] if hit else int(torch.randint(0, vocab, (1,), generator=g))
    real = torch.arange(n)[None, :] <= lengths[:, None]  # [B, N]
    node_row = torch.full((b, n), -1, dtype=torch.long)
    node_row[real] = torch.arange(int(real.sum()))
    return target, tokens, parents, logits[real].contiguous(), node_row


@pytest.mark.parametrize("b", [1, 2, 8])
def test_walk_equals_the_reference(b):
    g = torch.Generator().manual_seed(b)
    accepted = 0
    for trial in range(40):
        target, tokens, parents, matrix, node_row = random_case(g, b, 9, 64, follow=0.8)
        want = tree_accept(tokens, parents, target)
        got = greedy_tree_walk(matrix, node_row, tokens[:, 1:], parents)
        assert torch.equal(got.num_accepted, want.num_accepted), trial
        assert torch.equal(got.next_tokens, want.next_tokens), trial
        assert torch.equal(got.path, want.path), trial
        accepted += int(want.num_accepted.sum())
    assert accepted > 0  # the cases do accept drafts


def test_a_chain_and_its_first_rejection():
    vocab = 16
    logits = torch.full((4, vocab), -1.0)
    for i, t in enumerate([5, 6, 7, 8]):
        logits[i, t] = 1.0
    tokens = torch.tensor([[5, 6, 9]])  # node 3 (token 9) is rejected: the target wanted 7
    parents = torch.tensor([[-1, 0, 1, 2]])
    got = greedy_tree_walk(logits, torch.arange(4)[None], tokens, parents)
    assert got.num_accepted.tolist() == [2] and got.next_tokens.tolist() == [7]
    assert got.path.tolist() == [[0, 1, 2, -1]]


def test_refusals():
    logits = torch.zeros(2, 8)
    parents = torch.tensor([[-1, 0]])
    with pytest.raises(ValueError):  # the root has no row
        greedy_tree_walk(logits, torch.tensor([[-1, 1]]), torch.tensor([[0]]), parents)
    with pytest.raises(ValueError):  # shapes that do not fit the tree
        greedy_tree_walk(logits, torch.tensor([[0, 1]]), torch.tensor([[0, 1]]), parents)
    assert greedy_tree_walk(logits.double(), torch.tensor([[0, 1]]), torch.tensor([[0]]), parents) is None


def follow_samples(tokens, parents, probs, u, g, follow: float = 0.8) -> None:
    """Rewrite ``tokens`` in place so that, with probability ``follow`` per level, a child of each
    row's last accepted node drafts the target's sample there: walks then go deep."""
    from kernels.tree_verify import sampled_tree_verify

    b, n = parents.shape
    for _ in range(n):
        reference = sampled_tree_verify(tokens, parents, probs, u)
        for row in range(b):
            last = int(reference.path[row, int(reference.num_accepted[row])])
            kids = [i for i in range(1, n) if int(parents[row, i]) == last]
            if kids and float(torch.rand(1, generator=g)) < follow:
                tokens[row, kids[0]] = reference.next_tokens[row]


@pytest.mark.parametrize("b", [1, 3, 8])
def test_sampled_walk_draws_the_same_tokens_as_sampling_every_node(b):
    """The native sampled walk equals sample_from_uniform at every node + tree_accept, token for
    token: probabilities with zero mass (top-k cuts), drafts that follow the sample or not, and
    uniforms that round up to the total."""
    from kernels.tree_verify import sampled_tree_verify, sampled_tree_walk

    g = torch.Generator().manual_seed(10 + b)
    n, vocab, accepted = 7, 300, 0
    for trial in range(30):
        probs = torch.rand(b, n, vocab, generator=g) ** 4
        probs[probs < 0.05] = 0.0
        probs = probs / probs.sum(-1, keepdim=True)
        u = torch.rand(b, n, generator=g, dtype=torch.float64)
        u[0, 0] = 1.0 - 1e-17
        parents = torch.full((b, n), -1, dtype=torch.long)
        tokens = torch.zeros(b, n, dtype=torch.long)
        for row in range(b):
            for i in range(1, n):
                p = int(torch.randint(0, i, (1,), generator=g))
                parents[row, i] = p
                tokens[row, i] = int(torch.randint(0, vocab, (1,), generator=g))
        follow_samples(tokens, parents, probs, u, g)
        want = sampled_tree_verify(tokens, parents, probs, u)
        got = sampled_tree_walk(probs.contiguous(), tokens[:, 1:], parents, u)
        assert torch.equal(got.num_accepted, want.num_accepted), trial
        assert torch.equal(got.next_tokens, want.next_tokens), trial
        assert torch.equal(got.path, want.path), trial
        accepted += int(want.num_accepted.sum())
    assert accepted > 0


@pytest.mark.parametrize("b", [1, 8])
def test_sampled_walk_from_logits_samples_the_softmax_at_its_temperature(b):
    """At a temperature alone, the walk's own softmax (the kernels' vector exp, ~2e-7 from torch's)
    draws the tokens sampled_tree_verify draws from probs_from_logits: equal here, where no uniform
    falls within ~1e-6 of a boundary of the CDF."""
    from kernels.sampling import probs_from_logits
    from kernels.tree_verify import sampled_tree_verify, sampled_tree_walk_from_logits

    g = torch.Generator().manual_seed(20 + b)
    n, vocab, accepted = 6, 500, 0
    for trial in range(20):
        logits = 3 * torch.randn(b, n, vocab, generator=g)
        temp = 0.3 + torch.rand(b, generator=g)
        u = torch.rand(b, n, generator=g, dtype=torch.float64)
        probs = probs_from_logits(logits, temp)  # [B, N, V]
        parents = torch.full((b, n), -1, dtype=torch.long)
        tokens = torch.zeros(b, n, dtype=torch.long)
        for row in range(b):
            for i in range(1, n):
                parents[row, i] = int(torch.randint(0, i, (1,), generator=g))
        follow_samples(tokens, parents, probs, u, g)
        want = sampled_tree_verify(tokens, parents, probs, u)
        node_row = torch.arange(b * n).view(b, n)
        got = sampled_tree_walk_from_logits(logits.reshape(b * n, vocab).contiguous(), node_row,
                                            tokens[:, 1:], parents, temp, u)
        assert torch.equal(got.next_tokens, want.next_tokens), trial
        assert torch.equal(got.path, want.path), trial
        accepted += int(want.num_accepted.sum())
    assert accepted > 0
    with pytest.raises(ValueError):
        sampled_tree_walk_from_logits(torch.zeros(2, 4), torch.tensor([[0, 1]]), torch.tensor([[0]]),
                                      torch.tensor([[-1, 0]]), torch.tensor([0.0]), torch.zeros(1, 2))
