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


def test_greedy_rows_of_a_mixed_batch_verify_as_a_greedy_batch_does():
    """Greedy rows beside sampled ones take the same walk as an all-greedy batch (native where it
    applies, else the argmax at their verified nodes): the same paths on both, and the sampled row
    is verified by its own sampler."""
    from types import SimpleNamespace

    from serving.engine.drafting import DraftPlan
    from serving.engine.verify_step import verify_rows

    g = torch.Generator().manual_seed(3)
    b, k, vocab = 3, 4, 40
    logits = torch.randn(b, k + 1, vocab, generator=g)
    target = logits.argmax(-1)  # [B, K+1]
    tokens = target[:, :-1].clone()  # chains that follow the target ...
    tokens[0, 2] = (tokens[0, 2] + 1) % vocab  # ... but row 0's third draft
    plan = DraftPlan(tokens=tokens, lengths=torch.full((b,), k), probs=torch.ones(b, k),
                     source=torch.zeros(b, dtype=torch.uint8).numpy())
    parents = plan.node_parents()

    def row(temperature):
        return SimpleNamespace(params=SimpleNamespace(temperature=temperature, top_k=0, top_p=1.0),
                               num_output=5, seed=11)

    mixed = [row(0.0), row(1.0), row(0.0)]
    for dtype in (torch.float32, torch.float64):  # native walk, then the torch path
        out = ForwardOutput(logits.to(dtype))
        alone = verify_rows([row(0.0)] * b, plan, parents, out)
        assert alone.num_accepted.tolist() == [2, k, k]
        both = verify_rows(mixed, plan, parents, out)
        for r in (0, 2):
            assert both.num_accepted[r] == alone.num_accepted[r]
            assert both.next_tokens[r] == alone.next_tokens[r]
            assert torch.equal(both.path[r], alone.path[r])
        assert 0 <= int(both.num_accepted[1]) <= k


def test_trace_topk_reads_the_verified_positions_of_traced_rows_only():
    """Each traced row's positions 0..num_drafted hold the target's top-k at the logits row that
    position maps to; untraced rows and positions past num_drafted stay padded (-1 / -inf). The
    same on the native kernel (fp32) and the torch reference (fp64)."""
    from types import SimpleNamespace

    import numpy as np

    from serving.engine.drafting import DraftPlan
    from serving.engine.verify_step import trace_topk

    g = torch.Generator().manual_seed(5)
    b, k, vocab, t = 3, 4, 300, 6
    lengths = torch.tensor([2, 4, 0])
    plan = DraftPlan(tokens=torch.zeros(b, k, dtype=torch.long), lengths=lengths,
                     probs=torch.ones(b, k), source=np.zeros(b, dtype=np.uint8))
    view_rows = torch.tensor([[3, 0, 7, -1, -1], [1, 2, 4, 5, 6], [8, -1, -1, -1, -1]])  # [B, K+1]
    rows = [SimpleNamespace(request=SimpleNamespace(train=train)) for train in (True, False, True)]
    for dtype in (torch.float32, torch.float64):
        logits = (torch.randn(9, vocab, generator=g) * 4).to(dtype)  # [R, V]
        ids, lp = trace_topk(rows, plan, logits, view_rows, t)
        assert ids.shape == lp.shape == (b, k + 1, t)
        assert ids.dtype == np.int32 and lp.dtype == np.float16
        for r, j in [(0, 0), (0, 1), (0, 2), (2, 0)]:
            row = logits[int(view_rows[r, j])].double()
            top = row.topk(t)
            assert ids[r, j].tolist() == top.indices.tolist()
            want = (top.values - torch.logsumexp(row, -1)).numpy()
            np.testing.assert_allclose(lp[r, j].astype(np.float64), want, rtol=2e-3, atol=2e-3)
        padded = np.ones((b, k + 1), dtype=bool)
        padded[0, :3] = padded[2, 0] = False
        assert (ids[padded] == -1).all() and np.isneginf(lp[padded]).all()
