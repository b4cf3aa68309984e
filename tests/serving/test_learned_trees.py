"""Learned drafters branch on their runners-up: best-first token trees along the greedy chain
(serving/drafters/draft_tree.py), verified losslessly by the engine, merged by the hybrid, and
read back as acceptance trials."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from feedback.bus.trace import DrafterKind
from feedback.drafters.standalone_lm import standalone_from_target
from serving.drafters.base import DraftRequestView
from serving.drafters.draft_tree import best_first_tree, tree_trial
from serving.drafters.hybrid import HybridDrafter, HybridPolicy
from serving.drafters.standalone import StandaloneDrafter
from serving.engine.base import GenerationRequest, SamplingParams
from serving.engine.config import EngineConfig
from serving.engine.policy import FixedK
from serving.engine.reference import target_greedy_reference
from serving.engine.torch_engine import TorchEngine

NOISE = 0.02
PROMPTS = [[1, 2, 3, 4, 5], [7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12], [42, 42, 42], [5, 17]]


def _drafter(target, branches: int, noise: float = 0.0, sharpen: float = 1.0) -> StandaloneDrafter:
    """The target's first layer, its norm and head (``noise``: times a seeded Gaussian added to its
    layer's weights, so that its best token is often but not always the target's; ``sharpen``: its
    logits scaled, same ranking, more confident)."""
    model = standalone_from_target(target.model, num_layers=1, init="target-layers")
    if sharpen != 1.0:
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone() * sharpen)
    if noise:
        g = torch.Generator().manual_seed(11)
        with torch.no_grad():
            for p in model.model.layers.parameters():
                p.add_(noise * torch.randn(p.shape, generator=g))
    drafter = StandaloneDrafter(model, bf16=False)
    drafter.branches = branches
    return drafter


def _view(rid, seq, temperature=0.0):
    return DraftRequestView(rid, list(seq), max(1, len(seq) - 2), temperature=temperature)


def test_best_first_tree_orders_nodes_by_path_probability_with_parents_first():
    # two positions, three candidates each; position 1 was drafted after position 0's best (0.5)
    q = [[[0.5, 0.3, 0.1], [0.8, 0.1, 0.05]]]
    ids = [[[10, 11, 12], [20, 21, 22]]]
    tokens, conf, parents = best_first_tree(q, ids)
    # path probabilities: 10 .5, 11 .3, 12 .1, 20 .4, 21 .05, 22 .025
    assert tokens == [[10, 20, 11, 12, 21, 22]]
    assert parents == [[-1, 0, -1, -1, 0, 0]]  # position 1's candidates hang under token 10
    assert conf == [[0.5, 0.8, 0.3, 0.1, 0.1, 0.05]]  # each node's own probability given its parent
    # ties go to the parent: a child as likely as its parent's path never comes before it
    tokens, _, parents = best_first_tree([[[1.0, 0.0], [1.0, 0.0]]], [[[1, 2], [3, 4]]])
    assert tokens == [[1, 3, 2, 4]] and parents == [[-1, 0, -1, 0]]


@pytest.mark.parametrize("accepted, want", [
    ([10, 20, 99], (2, 2)),  # both levels accepted: no child of 20 was drafted, so no third trial
    ([11, 99], (1, 1)),  # the runner-up accepted: it has no children
    ([99], (1, 0)),  # nothing accepted: one trial, refused
])
def test_a_tree_step_reads_as_acceptance_trials_along_its_path(accepted, want):
    tokens, parents = [10, 20, 11], [-1, 0, -1]
    assert tree_trial(tokens, parents, accepted) == want


def test_a_chain_step_reads_as_acceptance_trials_until_the_first_refusal():
    assert tree_trial([1, 2, 3], None, [1, 9]) == (2, 1)
    assert tree_trial([1, 2, 3], None, [1, 2, 3, 9]) == (3, 3)


def test_a_greedy_tree_holds_the_chain_and_each_positions_runners_up(ids_target):
    chain, tree = _drafter(ids_target, 1), _drafter(ids_target, 3)
    seqs = {"a": [3, 1, 4, 1, 5, 9, 2, 6], "b": [2, 7], "c": [1, 8, 2, 8, 1, 8]}
    for drafter in (chain, tree):
        for rid, seq in seqs.items():
            drafter.add_request(_view(rid, seq))
    k = 3
    c = chain.propose([_view(r, s) for r, s in seqs.items()], k)
    t = tree.propose([_view(r, s) for r, s in seqs.items()], k)
    assert c.parents is None and t.parents is not None and t.dists is None
    assert t.lengths.tolist() == [k * 3] * 3
    for row, seq in enumerate(seqs.values()):
        toks, par, conf = t.tokens[row].tolist(), t.parents[row].tolist(), t.confidence[row].tolist()
        path_p = []
        for j in range(len(toks)):
            assert par[j] < j  # parents first: any prefix is a subtree
            path_p.append(conf[j] * (path_p[par[j]] if par[j] >= 0 else 1.0))
        assert all(a >= b - 1e-6 for a, b in itertools.pairwise(path_p))  # best first
        # the first child at each level is the chain's token; its siblings are the model's runners-up
        node, level, context = -1, 0, list(seq)
        while level < k:
            children = [j for j in range(len(toks)) if par[j] == node]
            with torch.no_grad():
                logits = tree.net.model(torch.tensor([context])).logits[0, -1]  # [V]
            assert [toks[j] for j in children] == logits.topk(3).indices.tolist()
            assert toks[children[0]] == int(c.tokens[row, level])
            node, level = children[0], level + 1
            context.append(toks[node])


def test_sampled_rows_draft_chains_with_their_distributions(ids_target):
    drafter = _drafter(ids_target, 3)
    views = [_view("a", [1, 2, 3], temperature=0.0), _view("b", [4, 5], temperature=0.8)]
    for v in views:
        drafter.add_request(v)
    p = drafter.propose(views, 2)
    assert p.parents is None and p.dists is not None and p.lengths.tolist() == [2, 2]


def test_a_draft_after_a_gap_reports_its_catch_up_apart():
    """Drafting every step commits one verify's tokens; a draft after a gap first commits the
    backlog, timed apart (DraftProposal.catch_up_ms), which the policy does not charge to drafting."""
    from serving.target import tiny_target

    target = tiny_target(vocab_size=101, hidden_size=64, num_layers=2, seed=3)
    drafter = _drafter(target, 2)
    view = _view("r", list(range(1, 40)))
    drafter.add_request(view)
    assert drafter.propose([view], 1).catch_up_ms > 0  # the prompt: a backlog
    view.token_ids = view.token_ids + [5, 6]
    drafter.on_verified("r", [5, 6], None)
    assert drafter.propose([view], 1).catch_up_ms == 0.0  # one verify's tokens: none
    more = list(range(60, 90))
    view.token_ids = view.token_ids + more
    drafter.on_verified("r", more, None)
    assert drafter.propose([view], 1).catch_up_ms > 0


def _serve(target, drafter, run, k=4):
    recorded = []

    class Recorder:
        def on_step(self, batch):
            recorded.append(batch)

    engine = TorchEngine(target, drafter, EngineConfig(k=k, max_batch_size=4), [Recorder()], policy=FixedK(1))
    reqs = [GenerationRequest(request_id=f"r{i}", prompt_ids=list(p), params=SamplingParams(max_tokens=30))
            for i, p in enumerate(PROMPTS)]
    outs = run(engine, reqs, delays=[0.0, 0.005, 0.01, 0.0, 0.02])
    for p, chunks in zip(PROMPTS, outs):
        assert [t for c in chunks for t in c.token_ids] == target_greedy_reference(target.model, p, 30)
    return recorded


def test_learned_trees_are_lossless_and_accept_more_than_chains(ids_target, run):
    """One drafted position a step (FixedK(1)): the chain verifies the drafter's best token, the
    tree also its two runners-up (three nodes, within the engine's k = 4); greedy output stays
    token-identical to target-only decoding, and the runners-up get accepted."""
    chain_steps = _serve(ids_target, _drafter(ids_target, 1, noise=NOISE), run)
    tree_steps = _serve(ids_target, _drafter(ids_target, 3, noise=NOISE), run)
    assert all(s.tree_nodes is None for s in chain_steps)
    trees = [s for s in tree_steps if s.tree_nodes is not None]
    assert trees and max(int(np.max(s.tree_nodes)) for s in trees) == 3
    assert {int(x) for s in trees for x in s.source} >= {DrafterKind.STANDALONE}

    def per_step(steps):
        return sum(int(np.sum(s.num_accepted)) for s in steps) / sum(len(s.request_ids) for s in steps)

    assert per_step(chain_steps) < 0.9  # the chain's best token is refused now and then...
    assert per_step(tree_steps) > per_step(chain_steps)  # ...where a runner-up is accepted


def test_a_tree_deeper_than_a_rows_room_is_cut_by_depth_not_by_nodes(ids_target, run):
    """k = 2 nodes a row: a one-position tree of three candidates keeps two (its best two), and a
    row with room for one more token keeps only depth-1 nodes."""
    from serving.engine.drafting import plan_from_proposal

    drafter = _drafter(ids_target, 3)
    views = [_view("a", [1, 2, 3]), _view("b", [4, 5, 6])]
    for v in views:
        drafter.add_request(v)
    p = drafter.propose(views, 2)  # 6 nodes a row, depth 2
    plan = plan_from_proposal(p, [0, 1], np.array([2, 1]), batch_size=2, vocab_size=101, max_nodes=4)
    depth_of = {-1: 0}
    lengths = plan.lengths.tolist()
    assert lengths[0] == 4  # the node budget
    par = plan.parents[1, : lengths[1]].tolist()
    assert all(q == -1 for q in par) and lengths[1] >= 1  # room for one token: depth 1 only
    for j, q in enumerate(plan.parents[0, : lengths[0]].tolist()):
        depth_of[j] = depth_of[q] + 1
    assert max(depth_of.values()) <= 2


def test_the_hybrid_merges_learned_trees_and_learns_from_their_paths(ids_target):
    """Rows without a suffix match take the learned tree; the hybrid's learned acceptance counts
    a runner-up accepted at the first level as one success, not a refusal of the chain."""
    from serving.drafters.suffix import SuffixConfig, SuffixDrafter

    learned = _drafter(ids_target, 3, sharpen=8.0)
    hybrid = HybridDrafter(SuffixDrafter(SuffixConfig()), learned,
                           HybridPolicy(prior_acceptance=0.5, target_step_ms=10.0, draft_ms_per_step=3.0,
                                        measure_verify=False, explore=0.0))  # one position pays
    view = _view("r", [1, 2, 3, 4])
    hybrid.add_request(view)
    p = hybrid.propose([view], 4)
    n = int(p.lengths[0])
    assert p.source[0] == DrafterKind.STANDALONE and p.parents is not None and n > 1
    roots = [j for j in range(n) if int(p.parents[0, j]) == -1]
    assert len(roots) == 3  # the learned drafter's best token and its two runners-up
    runner_up = int(p.tokens[0, roots[1]])
    before = hybrid.acceptance.value
    view.token_ids = view.token_ids + [runner_up, 7]
    hybrid.on_verified("r", [runner_up, 7], None)
    assert hybrid.acceptance.value > before  # one trial, accepted


def _hybrid_with_a_learned_tree(ids_target):
    from serving.drafters.suffix import SuffixConfig, SuffixDrafter

    learned = _drafter(ids_target, 3, sharpen=8.0)
    hybrid = HybridDrafter(SuffixDrafter(SuffixConfig()), learned,
                           HybridPolicy(prior_acceptance=0.5, target_step_ms=10.0, draft_ms_per_step=3.0,
                                        measure_verify=False, explore=0.0))
    view = _view("r", [1, 2, 3, 4])
    hybrid.add_request(view)
    p = hybrid.propose([view], 4)
    assert p.source[0] == DrafterKind.STANDALONE and int(p.lengths[0]) > 1
    return hybrid, view, p


def test_a_learned_draft_the_engine_cut_to_nothing_is_no_trial(ids_target):
    """The engine verifies a prefix of a draft (the policy's widths): one cut to nothing was never
    verified, so the hybrid's learned acceptance must not read it as a refusal."""
    hybrid, view, _ = _hybrid_with_a_learned_tree(ids_target)
    before = hybrid.acceptance.value
    hybrid.on_cut({"r": 0})
    view.token_ids = view.token_ids + [7]
    hybrid.on_verified("r", [7], None)  # the bonus token only
    assert hybrid.acceptance.value == before


def test_a_cut_learned_draft_counts_only_its_verified_nodes(ids_target):
    """Cut to its best node, which the target accepted: one trial, one success (counted as
    proposed, the best node's children were a refusal nobody verified)."""
    from feedback.goodput import AcceptanceEstimate

    hybrid, view, p = _hybrid_with_a_learned_tree(ids_target)
    want = AcceptanceEstimate(value=hybrid.acceptance.value, ema=hybrid.acceptance.ema,
                              prior_weight=hybrid.acceptance.prior_weight)
    want.observe(np.array([1]), np.array([1]))
    best = int(p.tokens[0, 0])
    hybrid.on_cut({"r": 1, "someone-else": 0})
    view.token_ids = view.token_ids + [best, 7]
    hybrid.on_verified("r", [best, 7], None)
    assert hybrid.acceptance.value == pytest.approx(want.value)


def test_the_engine_tells_the_drafter_what_it_verified_of_each_draft(ids_target, run):
    """TorchEngine's widths reach the drafter: with a width of one node, every draft of four
    reads as cut to one, and the output stays the target's own."""
    cuts = []

    class Recording(StandaloneDrafter):
        def on_cut(self, kept):
            cuts.append(dict(kept))

    class OneNode(FixedK):
        def choose_widths(self, parents, confidence, lengths, batch):
            return np.ones(batch, dtype=np.int64)

        def observe(self, *args, **kwargs):
            pass

    drafter = _drafter(ids_target, 1)
    drafter.__class__ = Recording
    engine = TorchEngine(ids_target, drafter, EngineConfig(k=4), policy=OneNode(4))
    prompt = PROMPTS[0]
    [chunks] = run(engine, [GenerationRequest("p", prompt, SamplingParams(temperature=0.0, max_tokens=6))])
    want = target_greedy_reference(ids_target.model, prompt, 6)
    assert [t for c in chunks for t in c.token_ids] == want
    assert cuts and all(kept == {"p": 1} for kept in cuts)


def test_a_learned_drafter_whose_drafts_are_cut_sits_out_growing_spans(ids_target):
    """A cut moves no estimate, so without more the hybrid would pay for a learned draft at every
    step that the engine then cuts: after a step whose learned drafts were all cut it sits out 1,
    then 3 steps, and one verified draft ends the streak."""
    hybrid, view, _ = _hybrid_with_a_learned_tree(ids_target)
    # a fixed draft price (2 ms a token against a 10 ms step): measured, this machine's speed
    # decided whether a learned draft at the end's acceptance (1/3) still paid (3.1 ms a token
    # measured in a full run: it did not, and the test failed)
    hybrid.costs.draft_ms_per_token = 2.0
    hybrid.costs.observe_draft = lambda num_tokens, ms: None
    calls = []
    propose = hybrid.learned.propose
    hybrid.learned.propose = lambda views, k: calls.append(len(views)) or propose(views, k)

    bonus = itertools.count(20)  # never a repeat: the suffix index finds nothing to draft

    def step(kept: int) -> bool:
        """One engine step: the draft, the engine's cut to ``kept`` nodes, a bonus token
        verified; whether the learned drafter was called."""
        before = len(calls)
        p = hybrid.propose([view], 4)
        hybrid.on_cut({"r": min(kept, int(p.lengths[0]))})
        token = next(bonus)
        view.token_ids = view.token_ids + [token]
        hybrid.on_verified("r", [token], None)
        return len(calls) > before

    hybrid.on_cut({"r": 0})  # the helper's draft: cut
    token = next(bonus)
    view.token_ids = view.token_ids + [token]
    hybrid.on_verified("r", [token], None)
    assert [step(0) for _ in range(2)] == [False, True]  # sat out 1, drafted, cut again
    assert [step(0) for _ in range(4)] == [False, False, False, True]  # sat out 3
    assert [step(1) for _ in range(8)] == [False] * 7 + [True]  # sat out 7, then verified...
    assert step(1)  # ...so it drafts at the next step again
