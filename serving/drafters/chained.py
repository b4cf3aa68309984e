"""A learned drafter's common case in one native call: one request, greedy.

``LearnedDrafter.propose`` drafts a batch of rows through a padded cache layout, masks and a loop
of per-position Python around its net's native kernels. For one greedy row, the net's
``DraftChain`` (kernels/draft_chain.py; ``PackedDraftNet.chain``) commits the row's pending inputs
and drafts all k positions in one call, on the row's own cache buffers, with the same kernels in
the same order, so the proposal is the batched path's (the same tokens and tree; probabilities
within ~1e-6). Measured on a 2-core AMD EPYC (Zen 4), a one-token draft of the two-layer standalone
drafter right after a SmolLM2-135M step: 1.46 ms through the batched path, of which its native
calls took 0.54 (ARCHITECTURE.md, "A draft in one native call").
"""

from __future__ import annotations

import torch

from serving.drafters.base import DraftRequestView
from serving.drafters.draft_kv import RowState
from serving.drafters.draft_tree import best_first_tree


def chained_draft(net, state: RowState, view: DraftRequestView, k: int, branches: int,
                  max_pending: int) -> tuple[torch.Tensor, torch.Tensor, None, torch.Tensor | None] | None:
    """One row's draft through ``net.chain``, as ``LearnedDrafter._draft`` returns a batch's:
    (tokens [1, n], probs [1, n], no distributions, parents [1, n] for a tree of ``branches`` > 1
    candidates a position, else None); or None where the batched path must draft it: no chain, a
    sampled row, a row that cannot draft or has features pending, more than ``max_pending`` inputs
    to commit (a backlog, which the batched path commits and times apart), or positions past the
    chain's rotary table. ``state`` is updated as the batched path updates it (its pending inputs
    committed)."""
    chain = getattr(net, "chain", None)
    if chain is None or view.temperature > 0 or k < 1 or not state.can_draft:
        return None
    q = state.num_pending
    if q > max_pending or state.pending_features:
        return None
    col, pos = state.length, state.length + state.skipped
    state.reserve(col + q + k - 1)
    if not chain.fits(col, pos, q, k, state.keys[0].shape[1]):
        return None
    m = min(branches, chain.head_rows)
    draft = chain(state.keys, state.values, state.pending_tokens, col, pos, state.last_hidden, k, m)
    if q:
        state.length += q
        state.pending_tokens.clear()
        state.last_hidden = draft.last_hidden
    if m > 1:
        tokens, confidence, parents = best_first_tree([draft.probs], [draft.ids])  # [1][k * m] each
        return torch.tensor(tokens), torch.tensor(confidence), None, torch.tensor(parents)
    return (torch.tensor([[ids[0] for ids in draft.ids]]), torch.tensor([[p[0] for p in draft.probs]]),
            None, None)
