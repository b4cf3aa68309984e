"""Tree verify: greedy walk equals sequential greedy decoding; chains equal the chain verifier;
sampled trees emit exactly the target's sequential samples (and so its distribution)."""

from __future__ import annotations

import itertools

import torch

from kernels.sampling import sample_from_uniform
from kernels.tree_verify import (
    chain_parents,
    greedy_tree_verify,
    sampled_tree_verify,
    tree_ancestors,
    tree_depths,
)
from kernels.verify import greedy_verify

V = 5


def _toy_probs(prefix: tuple[int, ...]) -> torch.Tensor:
    """A fixed 'target': next-token distribution as a function of the drafted prefix."""
    g = torch.Generator().manual_seed(hash(prefix) % (2**31))
    p = torch.rand(V, generator=g) ** 3 + 0.01
    return p / p.sum()


def _random_tree(n: int, g: torch.Generator) -> tuple[list[int], list[int]]:
    """Node tokens and parents (node 0 = root), distinct tokens among siblings."""
    tokens, parents = [0], [-1]
    for i in range(1, n):
        p = int(torch.randint(0, i, (1,), generator=g))
        used = {tokens[j] for j in range(1, i) if parents[j] == p}
        free = [t for t in range(V) if t not in used]
        if not free:
            parents.append(-1)  # padding node
            tokens.append(0)
            continue
        parents.append(p)
        tokens.append(free[int(torch.randint(0, len(free), (1,), generator=g))])
    return tokens, parents


def _prefix(tokens, parents, i) -> tuple[int, ...]:
    out = []
    while i > 0:
        out.append(tokens[i])
        i = parents[i]
    return tuple(reversed(out))


def _tree_probs(tokens, parents) -> torch.Tensor:
    return torch.stack([_toy_probs(_prefix(tokens, parents, i)) for i in range(len(tokens))])


def test_depths_and_ancestors():
    parents = torch.tensor([[-1, 0, 0, 1, 3, -1]])
    assert tree_depths(parents).tolist() == [[0, 1, 1, 2, 3, 1]]
    anc = tree_ancestors(parents)[0]
    assert anc[4].nonzero().flatten().tolist() == [0, 1, 3, 4]
    assert anc[2].nonzero().flatten().tolist() == [0, 2]
    assert anc[5].nonzero().flatten().tolist() == [0, 5]


def test_chain_equals_chain_verifier():
    g = torch.Generator().manual_seed(0)
    b, k = 64, 6
    drafts = torch.randint(0, 3, (b, k), generator=g)
    lengths = torch.randint(0, k + 1, (b,), generator=g)
    logits = torch.randn(b, k + 1, 3, generator=g)
    ref = greedy_verify(drafts, lengths, logits)
    tokens = torch.cat([torch.zeros(b, 1, dtype=torch.long), drafts], dim=1)
    res = greedy_tree_verify(tokens, chain_parents(lengths, k + 1), logits)
    assert torch.equal(res.num_accepted, ref.num_accepted)
    assert torch.equal(res.next_tokens, ref.next_tokens)
    for row in range(b):
        a = int(ref.num_accepted[row])
        assert res.path[row, : a + 1].tolist() == list(range(a + 1))


def test_greedy_tree_equals_sequential_greedy():
    g = torch.Generator().manual_seed(1)
    for _ in range(200):
        tokens, parents = _random_tree(int(torch.randint(1, 12, (1,), generator=g)), g)
        probs = _tree_probs(tokens, parents)
        res = greedy_tree_verify(
            torch.tensor([tokens]), torch.tensor([parents]), probs.log()[None]
        )
        # sequential greedy: keep decoding while the argmax continuation is in the tree
        seq, node = [], 0
        while True:
            y = int(_toy_probs(tuple(seq)).argmax())
            seq.append(y)
            kids = [i for i in range(1, len(tokens)) if parents[i] == node and tokens[i] == y]
            if not kids:
                break
            node = kids[0]
        path = res.path[0]
        emitted = [tokens[int(i)] for i in path[1 : int(res.num_accepted[0]) + 1]]
        assert emitted + [int(res.next_tokens[0])] == seq


def test_sampled_tree_emits_the_sequential_samples():
    """Same uniform per depth -> tree output == sequential sampling, draft by draft."""
    g = torch.Generator().manual_seed(2)
    for _ in range(300):
        tokens, parents = _random_tree(int(torch.randint(1, 10, (1,), generator=g)), g)
        probs = _tree_probs(tokens, parents)
        u_depth = torch.rand(len(tokens) + 1, generator=g, dtype=torch.float64)
        depth = tree_depths(torch.tensor([parents]))[0]
        res = sampled_tree_verify(
            torch.tensor([tokens]), torch.tensor([parents]), probs[None], u_depth[depth][None]
        )
        seq = []
        for d in range(int(res.num_accepted[0]) + 1):
            p = _toy_probs(tuple(seq))
            seq.append(int(sample_from_uniform(p[None], u_depth[d : d + 1])[0]))
        path = res.path[0]
        emitted = [tokens[int(i)] for i in path[1 : int(res.num_accepted[0]) + 1]]
        assert emitted + [int(res.next_tokens[0])] == seq


def test_sampled_tree_distribution():
    """Statistical: the first two emitted tokens follow the target's joint distribution."""
    tokens = [0, 1, 2, 3, 4]  # root with children 1, 2 and grandchildren under 1
    parents = [-1, 0, 0, 1, 1]
    probs = _tree_probs(tokens, parents)
    n = 40_000
    g = torch.Generator().manual_seed(3)
    depth = tree_depths(torch.tensor([parents]))[0]
    u = torch.rand(n, 3, generator=g, dtype=torch.float64)
    res = sampled_tree_verify(
        torch.tensor([tokens]).expand(n, -1),
        torch.tensor([parents]).expand(n, -1),
        probs[None].expand(n, -1, -1),
        u[:, depth],
    )
    # second token for rows that emitted only one: sample it from the target after the first
    first = torch.where(
        res.num_accepted >= 1, torch.tensor(tokens)[res.path[:, 1].clamp(min=0)], res.next_tokens
    )
    counts = torch.zeros(V, dtype=torch.float64)
    counts.index_add_(0, first, torch.ones(n, dtype=torch.float64))
    expected = _toy_probs(()).double() * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 25.0, chi2  # 4 dof: p ~ 5e-5
    # joint of (first, second) where the tree covered the second position
    pairs = {}
    two = res.num_accepted >= 1
    second = torch.where(
        res.num_accepted >= 2, torch.tensor(tokens)[res.path[:, 2].clamp(min=0)], res.next_tokens
    )
    for a, bb in zip(first[two].tolist(), second[two].tolist()):
        pairs[(a, bb)] = pairs.get((a, bb), 0) + 1
    p0 = _toy_probs(())
    chi2 = 0.0
    for a, bb in itertools.product((1, 2), range(V)):
        e = float(p0[a] * _toy_probs((a,))[bb]) * n
        chi2 += (pairs.get((a, bb), 0) - e) ** 2 / e
    assert chi2 < 40.0, chi2  # 9 dof


def test_the_cpu_walk_and_the_device_walk_accept_the_same_paths():
    """tree_accept walks lists on the CPU and tensors elsewhere: same paths on random trees (with
    padding nodes, duplicate sibling tokens and targets that follow or leave the tree)."""
    from kernels.tree_verify import _tree_accept_lists, _tree_accept_tensors

    g = torch.Generator().manual_seed(7)
    deepest = 0
    for n in (1, 2, 5, 9, 17):
        b = 32
        parents = torch.full((b, n), -1, dtype=torch.long)
        for i in range(1, n):
            parents[:, i] = torch.randint(-1, i, (b,), generator=g)  # -1: a padding node
        tokens = torch.randint(0, 2, (b, n), generator=g)
        target = torch.randint(0, 2, (b, n), generator=g)
        a = _tree_accept_lists(tokens, parents, target)
        t = _tree_accept_tensors(tokens, parents, target)
        assert torch.equal(a.num_accepted, t.num_accepted)
        assert torch.equal(a.next_tokens, t.next_tokens) and torch.equal(a.path, t.path)
        deepest = max(deepest, int(a.num_accepted.max()))
    assert deepest >= 3  # the draws do walk into the trees


def test_cpu_depths_and_ancestors_equal_the_device_recurrences():
    from kernels.tree_verify import _tree_ancestors_tensors, _tree_depths_tensors

    g = torch.Generator().manual_seed(3)
    for n in (1, 2, 6, 17):
        parents = torch.full((5, n), -1, dtype=torch.long)
        for i in range(1, n):
            parents[:, i] = torch.randint(-1, i, (5,), generator=g)
        assert torch.equal(tree_depths(parents), _tree_depths_tensors(parents))
        assert torch.equal(tree_ancestors(parents), _tree_ancestors_tensors(parents))
    chain = chain_parents(torch.tensor([3]), 5)  # [-1, 0, 1, 2, -1]
    assert tree_depths(chain).tolist() == [[0, 1, 2, 3, 1]]
