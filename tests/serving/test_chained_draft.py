"""A learned drafter's one-row greedy draft in one native call (serving/drafters/chained.py,
kernels/draft_chain.py) proposes what the batched path proposes, and leaves the row's state as
that path leaves it: the same tokens and trees, probabilities within float rounding, the same
committed length, hidden state and cache contents, step after step."""

import random

import pytest
import torch

from serving.drafters import build_drafter
from serving.drafters.base import DraftRequestView
from serving.drafters.standalone import PackedDraftNet
from serving.target import tiny_target

V = 256
pytestmark = pytest.mark.skipif(
    not PackedDraftNet.supports(tiny_target(vocab_size=V, hidden_size=64).model),
    reason="native kernels not built",
)


class _CountingChain:
    """The net's chain, counting its calls (so that a test knows the fused path ran)."""

    def __init__(self, chain):
        self.chain, self.calls = chain, 0

    def __getattr__(self, name):
        return getattr(self.chain, name)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.chain(*args, **kwargs)


def _pair(kind: str, branches: int):
    """Two drafters of one target and shape: the first drafts through its chain, the second through
    the batched path (its chain taken away)."""
    target = tiny_target(vocab_size=V, hidden_size=64, num_layers=4, seed=3)
    options = {"exit_layer": 2, "adapter_layers": 1} if kind == "selfspec" else {"num_layers": 2}
    fused, batched = (build_drafter(kind, target, draft_vocab_size=128, branches=branches, **options)
                      for _ in range(2))
    if fused.net.chain is None:
        pytest.skip("the draft chain is not built here")
    fused.net.chain = _CountingChain(fused.net.chain)
    batched.net.chain = None
    return fused, batched


def _same_state(a, b):
    assert a.length == b.length and a.skipped == b.skipped
    assert a.pending_tokens == b.pending_tokens
    assert torch.equal(a.last_hidden, b.last_hidden)
    for ka, kb, va, vb in zip(a.keys, b.keys, a.values, b.values):
        assert torch.equal(ka[:, : a.length], kb[:, : b.length])
        assert torch.equal(va[:, : a.length], vb[:, : b.length])


@pytest.mark.parametrize("kind,branches", [("standalone", 1), ("standalone", 3), ("selfspec", 2)])
def test_one_greedy_row_drafts_as_the_batched_path_does(kind, branches):
    fused, batched = _pair(kind, branches)
    rng = random.Random(7)
    history = [rng.randrange(V) for _ in range(23)]
    for d in (fused, batched):
        d.add_request(DraftRequestView("r", list(history), len(history) - 1))
    for step in range(24):
        k = rng.randint(1, 4)
        view = DraftRequestView("r", list(history), len(history) - 1)
        a, b = fused.propose([view], k), batched.propose([view], k)
        assert a.tokens.tolist() == b.tokens.tolist(), step
        assert a.lengths.tolist() == b.lengths.tolist()
        assert (a.parents is None) == (b.parents is None)
        if a.parents is not None:
            assert a.parents.tolist() == b.parents.tolist()
        assert torch.allclose(a.probs, b.probs, atol=1e-5, rtol=1e-4)
        assert torch.allclose(a.confidence, b.confidence, atol=1e-5, rtol=1e-4)
        assert a.probs.dtype == b.probs.dtype and a.tokens.dtype == b.tokens.dtype
        assert list(a.source) == list(b.source) and a.dists is None and b.dists is None
        _same_state(fused._states["r"], batched._states["r"])
        # the target commits 1-3 tokens (the drafter never sees which were its own), and now and
        # then several steps pass without a draft (a backlog: the batched path commits it first)
        accepted = [rng.randrange(V) for _ in range(rng.randint(1, 3 if step % 5 else 9))]
        history += accepted
        for d in (fused, batched):
            d.on_verified("r", accepted, None)
    assert fused.net.chain.calls >= 18  # the backlog steps went the batched way


def test_sampled_rows_and_batches_keep_the_batched_path():
    fused, _ = _pair("standalone", 2)
    views = [DraftRequestView(f"r{i}", [5, 6, 7, 8 + i], 3) for i in range(2)]
    for v in views:
        fused.add_request(v)
    fused.propose(views, 3)  # a batch of two rows
    sampled = DraftRequestView("r0", [5, 6, 7, 8], 3, temperature=0.7)
    out = fused.propose([sampled], 2)  # a sampled row drafts chains with their distributions
    assert fused.net.chain.calls == 0
    assert out.dists is not None and out.parents is None


def test_the_chain_refuses_a_token_outside_the_vocabulary():
    fused, _ = _pair("standalone", 1)
    fused.add_request(DraftRequestView("r", [1, 2, 3], 2))
    state = fused._states["r"]
    state.reserve(8)
    with pytest.raises(ValueError, match="draft_chain refused"):
        fused.net.chain(state.keys, state.values, [V + 5], 0, 0, None, 2, 1)
