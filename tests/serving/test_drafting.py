"""plan_from_proposal: a drafter's proposal checked and scattered into the batch's plan."""

import numpy as np
import pytest
import torch

from feedback.bus.trace import DrafterKind
from serving.drafters.base import DraftProposal
from serving.engine.drafting import DraftPlan, plan_from_proposal

V = 50


def _proposal(tokens, lengths, parents=None, confidence=None, dists=None):
    tokens = torch.tensor(tokens)
    n = tokens.shape[0]
    return DraftProposal(
        tokens=tokens, lengths=torch.tensor(lengths), probs=torch.full(tokens.shape, 0.5),
        source=np.full(n, DrafterKind.SUFFIX, dtype=np.uint8),
        parents=None if parents is None else torch.tensor(parents),
        confidence=None if confidence is None else torch.tensor(confidence), dists=dists,
    )


def test_rows_are_scattered_and_cut_at_caps_and_at_the_first_token_out_of_range():
    p = _proposal([[1, 2, 3, 4], [5, V, 7, 8], [9, 10, 11, 12]], [4, 4, 4],
                  confidence=[[0.9, 0.8, 0.7, 0.6]] * 3)
    caps = np.array([8, 2, 8, 8, 8])
    plan = plan_from_proposal(p, [1, 2, 4], caps, batch_size=5, vocab_size=V)
    assert plan.lengths.tolist() == [0, 2, 1, 0, 4]  # row 1: cap 2; row 2: token V is out of range
    assert plan.tokens.tolist() == [[0] * 4, [1, 2, 0, 0], [5, 0, 0, 0], [0] * 4, [9, 10, 11, 12]]
    assert plan.probs[1].tolist() == [0.5, 0.5, 0.0, 0.0] and plan.probs[0].sum() == 0
    assert plan.confidence[2].tolist() == pytest.approx([0.9, 0, 0, 0])
    assert plan.source.tolist() == [DrafterKind.NONE, DrafterKind.SUFFIX, DrafterKind.SUFFIX,
                                    DrafterKind.NONE, DrafterKind.SUFFIX]
    assert plan.tokens.dtype == torch.int64 and plan.lengths.dtype == torch.int64
    assert plan.parents is None and not plan.is_tree()


def test_a_tree_is_cut_before_its_first_node_whose_parent_does_not_come_earlier():
    p = _proposal([[1, 2, 3, 4], [5, 6, 7, 8]], [4, 4], parents=[[-1, 0, 0, 1], [-1, 0, 3, 1]])
    plan = plan_from_proposal(p, [0, 1], np.array([8, 8]), batch_size=2, vocab_size=V)
    assert plan.lengths.tolist() == [4, 2]
    assert plan.parents.tolist() == [[-1, 0, 0, 1], [-1, 0, 1, 2]]  # beyond a row's nodes: a chain
    assert plan.node_parents().tolist() == [[-1, 0, 1, 1, 2], [-1, 0, 1, -1, -1]]


def test_nothing_to_draft_is_the_empty_plan_and_bad_shapes_are_refused():
    p = _proposal([[1, 2], [3, 4]], [0, 0])
    assert plan_from_proposal(p, [0, 1], np.array([8, 8]), 2, V).k == 0
    with pytest.raises(ValueError, match="tokens must be"):
        plan_from_proposal(_proposal([[1, 2]], [2]), [0, 1], np.array([8, 8]), 2, V)
    with pytest.raises(ValueError, match="point-mass"):
        plan_from_proposal(_proposal([[1, 2]], [2], parents=[[-1, 0]], dists=torch.zeros(1, 2, V)),
                           [0], np.array([8]), 1, V)


def test_a_proposal_zero_drafts_wide_is_the_empty_plan():
    """A proposal of width 0 (every row found nothing) is not a drafter error: numpy's argmax over
    its empty rows raised, and the engine logged and counted one."""
    p = _proposal(torch.zeros(2, 0, dtype=torch.long), [0, 0], parents=torch.zeros(2, 0, dtype=torch.long))
    assert plan_from_proposal(p, [0, 1], np.array([8, 8]), 2, V).k == 0


def test_a_tree_node_deeper_than_its_row_may_emit_ends_the_row():
    # row cap 2: the node at depth 3 (draft 3) goes, and with it every later node
    p = _proposal([[1, 2, 3, 4, 5]], [5], parents=[[-1, 0, -1, 1, 0]])
    plan = plan_from_proposal(p, [0], np.array([2]), 1, V, max_nodes=8)  # caps bound depth only
    assert plan.lengths.tolist() == [3] and plan.parents.tolist() == [[-1, 0, -1]]


def test_draft_distributions_follow_their_rows():
    dists = torch.softmax(torch.randn(1, 3, V), -1)
    plan = plan_from_proposal(_proposal([[1, 2, 3]], [3], dists=dists), [1], np.array([8, 8]), 2, V)
    assert torch.equal(plan.dists[1], dists[0]) and plan.dists[0].sum() == 0


def test_the_plain_plan_is_made_once_per_batch_size_and_cannot_be_written():
    """A plain step allocates nothing: its plan is shared, so nobody may write into it."""
    plan = DraftPlan.none(3)
    assert DraftPlan.none(3) is plan and DraftPlan.none(4) is not plan
    assert plan.k == 0 and plan.lengths.tolist() == [0, 0, 0]
    with pytest.raises(ValueError):
        plan.source[0] = 1
