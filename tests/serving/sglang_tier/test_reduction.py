"""The verify-step reduction on synthetic tensors shaped like SGLang's eagle_sample I/O (CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sglang_fakes import logits_preferring, make_verify_step

from serving.sglang.reduction import (
    StepLayout,
    from_sglang,
    reduce_verify_step,
    summarize_target,
    trace_path,
    unpack_step,
)

V, T = 50, 5


def run(tokens, parents, targets, topk, depth, seq_lens, draft_probs=None, rows=None):
    logits = logits_preferring(targets, V)  # [B, N, V]
    vi, _, _, (predict, accept_lens, accept_index) = make_verify_step(
        tokens, parents, logits, seq_lens, topk, depth, draft_probs)
    step = from_sglang(vi, predict, accept_lens, accept_index)
    ids, lps = summarize_target(logits, T)
    if rows is not None:
        rows = torch.tensor(rows)
        step, ids, lps = step.select(rows), ids[rows], lps[rows]
    packed = reduce_verify_step(step, ids, lps)
    assert packed.dtype == torch.int32 and packed.shape[1] == StepLayout(depth, T).width
    return unpack_step(packed.numpy(), StepLayout(depth, T)), logits


def expected_topk(logits_row: torch.Tensor):
    lp = torch.log_softmax(logits_row.float(), -1)
    vals, ids = lp.topk(T)
    return ids.numpy(), vals.numpy()


CHAIN_PARENTS = [-1, 0, 1, 2]  # topk=1, 3 steps: root -> d1 -> d2 -> d3


def test_chain_keeps_discarded_positions():
    tokens = [[7, 11, 12, 13], [8, 21, 22, 23]]
    # request 0: target agrees with d1 only; request 1: agrees with all three drafts
    targets = [[11, 30, 31, 32], [21, 22, 23, 40]]
    out, logits = run(tokens, CHAIN_PARENTS, targets, topk=1, depth=3, seq_lens=[10, 20])

    assert out.num_drafted.tolist() == [3, 3]
    assert out.num_accepted.tolist() == [1, 3]
    assert out.root_pos.tolist() == [10, 20]
    assert out.draft_ids.tolist() == [[11, 12, 13], [21, 22, 23]]
    assert out.emitted == [[11, 30], [21, 22, 23, 40]]
    # the target's top-k at all k+1 positions, the rejected branch included
    for r in range(2):
        for j in range(4):
            ids, lps = expected_topk(logits[r, j])
            np.testing.assert_array_equal(out.target_topk_ids[r, j], ids)
            np.testing.assert_allclose(out.target_topk_logprobs[r, j], lps, atol=2e-3)
    assert out.target_topk_logprobs.dtype == np.float16
    assert np.isnan(out.draft_probs).all()  # SGLang keeps no q outside rejection sampling


# topk=2 tree, 2 steps: root(0) -> {1, 2}; 1 -> 3; 2 -> 4
TREE_PARENTS = [-1, 0, 0, 1, 2]


def test_tree_follows_accepted_sibling_then_first_child():
    tokens = [[5, 11, 12, 13, 14], [6, 21, 22, 23, 24]]
    targets = [
        [12, 0, 40, 0, 0],  # req 0: takes sibling 2, rejects its child 4
        [30, 0, 0, 0, 0],  # req 1: rejects both children of the root
    ]
    out, logits = run(tokens, TREE_PARENTS, targets, topk=2, depth=2, seq_lens=[10, 20])

    assert out.num_accepted.tolist() == [1, 0]
    assert out.num_drafted.tolist() == [2, 2]
    # req 0: path 0 -> 2 -> 4 ; req 1: discarded branch along first children 0 -> 1 -> 3
    assert out.draft_ids.tolist() == [[12, 14], [21, 23]]
    assert out.emitted == [[12, 40], [30]]
    for r, path in enumerate([[0, 2, 4], [0, 1, 3]]):
        for j, node in enumerate(path):
            ids, _ = expected_topk(logits[r, node])
            np.testing.assert_array_equal(out.target_topk_ids[r, j], ids)


def test_tree_path_shorter_than_depth_is_padded():
    parents = [-1, 0, 0, 2]  # node 1 is a leaf at depth 1
    tokens = [[5, 11, 12, 13]]
    targets = [[40, 0, 0, 0]]  # nothing accepted: continue along the first child (leaf 1)
    out, _ = run(tokens, parents, targets, topk=2, depth=2, seq_lens=[3])
    assert out.num_drafted.tolist() == [1]
    assert out.draft_ids.tolist() == [[11, -1]]
    assert (out.target_topk_ids[0, 2] == -1).all()
    assert np.isneginf(out.target_topk_logprobs[0, 2]).all()
    assert not (out.target_topk_ids[0, :2] == -1).any()


def test_trace_path_chain_shortcut_matches_the_walk():
    tokens = [[7, 11, 12, 13], [8, 21, 22, 23]]
    targets = [[11, 30, 31, 32], [49, 22, 23, 40]]
    logits = logits_preferring(targets, V)
    vi, _, _, (predict, lens, index) = make_verify_step(tokens, CHAIN_PARENTS, logits, [1, 1], 1, 3)
    chain = from_sglang(vi, predict, lens, index)
    assert chain.is_chain
    walked = trace_path(chain.__class__(**{**chain.__dict__, "is_chain": False}))
    assert torch.equal(trace_path(chain), walked)


def test_selected_rows_match_the_full_batch():
    tokens = [[7, 11, 12, 13], [8, 21, 22, 23], [9, 31, 32, 33]]
    targets = [[11, 30, 31, 32], [21, 22, 0, 0], [0, 0, 0, 0]]
    full, _ = run(tokens, CHAIN_PARENTS, targets, 1, 3, [4, 5, 6])
    some, _ = run(tokens, CHAIN_PARENTS, targets, 1, 3, [4, 5, 6], rows=[2, 0])
    assert some.num_accepted.tolist() == [full.num_accepted[2], full.num_accepted[0]]
    np.testing.assert_array_equal(some.target_topk_ids, full.target_topk_ids[[2, 0]])
    assert some.emitted == [full.emitted[2], full.emitted[0]]


def test_draft_q_is_gathered_when_sglang_keeps_it():
    tokens = [[7, 11, 12, 13]]
    q = torch.rand(1, 3, V)  # [B, steps, V]
    out, _ = run(tokens, CHAIN_PARENTS, [[11, 12, 0, 0]], 1, 3, [4], draft_probs=q)
    np.testing.assert_allclose(out.draft_probs[0], [q[0, 0, 11], q[0, 1, 12], q[0, 2, 13]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_summarize_target_is_full_vocab_log_softmax(dtype):
    logits = torch.randn(2, 3, V).to(dtype)
    ids, lps = summarize_target(logits, T)
    ref = torch.log_softmax(logits.float(), -1).topk(T)
    assert ids.dtype == torch.int32 and ids.shape == (2, 3, T)
    torch.testing.assert_close(lps, ref.values)
    assert torch.equal(ids.long(), ref.indices)
