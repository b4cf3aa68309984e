"""The accept and report stages of TorchEngine's step, as functions of what the step computed.

``verify_rows``: each row's longest path the target agrees with (greedy, position-keyed sampling,
or rejection sampling for chains with draft distributions). ``step_report``: the step as observers
see it (a VerifyBatch, numpy on the CPU), with the target's top-k at verified positions of traced
rows when an observer wants it.
"""

from __future__ import annotations

import functools
import time

import numpy as np
import torch

from kernels.argmax_rows import argmax_rows
from kernels.sampling import probs_from_logits
from kernels.topk_logprobs import topk_logprobs, topk_logprobs_padded
from kernels.tree_verify import (
    TreeVerifyResult,
    greedy_tree_walk,
    sampled_tree_verify,
    sampled_tree_walk,
    sampled_tree_walk_from_logits,
    tree_accept,
    tree_depths,
)
from kernels.verify import rejection_verify
from serving.engine.base import VerifyBatch
from serving.engine.drafting import DraftPlan
from serving.engine.rows import Row
from serving.engine.seeded import position_uniforms
from serving.engine.tree import linear_view


def greedy_targets(out, lengths: torch.Tensor, only: torch.Tensor | None = None) -> torch.Tensor:
    """[B, K+1] the target's argmax at each row's verified nodes (0..lengths[b]; 0 elsewhere, never
    read), reading those rows of the forward's logits alone (``logit_rows``). ``only`` [B] bool:
    the rows to compute (default all)."""
    matrix, node_row = logit_rows(out)  # [R, V], [B, K+1]
    if matrix.device.type == "cpu":  # numpy masks: a few us each where torch's cost ~10 (batch 1)
        rows = node_row.numpy()
        verified = np.arange(rows.shape[1])[None, :] <= lengths.numpy()[:, None]  # [B, K+1]
        if only is not None:
            verified &= only.numpy()[:, None]
        target = np.zeros(rows.shape, dtype=np.int64)
        target[verified] = argmax_rows(matrix, torch.from_numpy(rows[verified])).numpy()
        return torch.from_numpy(target)
    verified = torch.arange(node_row.shape[1])[None, :] <= lengths[:, None]  # [B, K+1]
    if only is not None:
        verified &= only[:, None]
    target = torch.zeros(node_row.shape, dtype=torch.long, device=matrix.device)
    target[verified.to(matrix.device)] = argmax_rows(matrix, node_row[verified])
    return target


def verify_rows(rows: list[Row], plan: DraftPlan, parents: torch.Tensor, out) -> TreeVerifyResult:
    """Accept each row's longest path the target agrees with (a chain is a one-branch tree).
    ``parents`` [B, K+1] (node 0 = the last committed token); ``out`` the verify forward's output
    (``.logits`` [B, K+1, V])."""
    batch, n = parents.shape
    sampled = [b for b, r in enumerate(rows) if r.params.temperature > 0]
    matrix, node_row = logit_rows(out)  # [R, V], [B, K+1]
    if not sampled:
        return _greedy_rows(out, matrix, node_row, plan, parents)
    device = matrix.device
    parents = parents.to(device)  # [B, K+1]
    num_accepted = torch.zeros(batch, dtype=torch.long, device=device)
    next_tokens = torch.zeros(batch, dtype=torch.long, device=device)
    path = torch.full((batch, n), -1, dtype=torch.long, device=device)
    greedy = [b for b in range(batch) if rows[b].params.temperature == 0]
    if greedy:
        g = torch.tensor(greedy, device=device)
        res = _greedy_rows(out, matrix, node_row, plan, parents, greedy)
        num_accepted[g], next_tokens[g], path[g] = res.num_accepted, res.next_tokens, res.path
    if plan.dists is None and matrix.device.type == "cpu":
        # rows sampled at a temperature alone: the softmax and the sample at the nodes the walk
        # reaches only, natively; always so for such a row, whatever else is in the batch, so
        # that its tokens do not depend on the batch it runs in
        plain = [b for b in sampled if rows[b].params.top_k == 0 and rows[b].params.top_p >= 1.0]
        if plain:
            p = torch.tensor(plain)
            prows = [rows[b] for b in plain]
            res = sampled_tree_walk_from_logits(
                matrix, node_row[p], plan.tokens[p], parents[p],
                torch.tensor([r.params.temperature for r in prows], dtype=torch.float32),
                torch.from_numpy(_uniforms(prows, parents[p])),
            )
            if res is not None:
                num_accepted[p], next_tokens[p], path[p] = res.num_accepted, res.next_tokens, res.path
                taken = set(plain)
                sampled = [b for b in sampled if b not in taken]
                if not sampled:
                    return TreeVerifyResult(num_accepted, next_tokens, path)
    s = torch.tensor(sampled, device=device)
    srows = [rows[b] for b in sampled]
    # the sampled rows' logits read from the forward's own rows: no padded [B, K+1, V] layout
    # (~0.4 ms a step on the CPU); a padding node reads row 0, and no walk reaches one
    rows_s = node_row.to(device)[s].clamp(min=0)  # [Bs, K+1]
    probs = probs_from_logits(
        matrix.index_select(0, rows_s.reshape(-1)).view(*rows_s.shape, -1),  # [Bs, K+1, V]
        torch.tensor([r.params.temperature for r in srows], device=device),
        torch.tensor([r.params.top_k for r in srows], device=device),
        torch.tensor([r.params.top_p for r in srows], device=device),
    )  # [Bs, K+1, V]
    if plan.dists is None:
        u = torch.from_numpy(_uniforms(srows, parents[s]))  # [Bs, K+1]
        res = sampled_tree_walk(probs, plan.tokens[s.cpu()], parents[s], u)  # native, on the CPU
        if res is None:
            tokens = _root_and_drafts(plan).to(device)  # [B, K+1]
            res = sampled_tree_verify(tokens[s], parents[s], probs, u.to(device))
        num_accepted[s], next_tokens[s], path[s] = res.num_accepted, res.next_tokens, res.path
    else:  # chains of drafts with distributions: lossless rejection sampling
        chain = rejection_verify(
            plan.tokens.to(device)[s],
            plan.lengths.to(device)[s],
            plan.probs.to(device)[s],
            plan.dists.to(device)[s],
            probs,
            [r.generator for r in srows],
        )
        steps = torch.arange(n, device=device)[None, :]  # [1, K+1]
        num_accepted[s], next_tokens[s] = chain.num_accepted, chain.next_tokens
        path[s] = torch.where(steps <= chain.num_accepted[:, None], steps, -1)
    return TreeVerifyResult(num_accepted, next_tokens, path)


def _greedy_rows(out, matrix: torch.Tensor, node_row: torch.Tensor, plan: DraftPlan,
                 parents: torch.Tensor, rows: list[int] | None = None) -> TreeVerifyResult:
    """The verify of the greedy ``rows`` (None: every row), in their order: the native walk on the
    CPU, else the target's argmax at their verified nodes (``greedy_targets``) and ``tree_accept``."""
    pick = slice(None) if rows is None else torch.tensor(rows)
    walked = greedy_tree_walk(matrix, node_row[pick], plan.tokens[pick], parents[pick])
    if walked is not None:
        return walked
    only = None
    if rows is not None:
        only = torch.zeros(len(plan.lengths), dtype=torch.bool)
        only[rows] = True
    target = greedy_targets(out, plan.lengths, only=only)  # [B, K+1]
    device = target.device
    tokens = _root_and_drafts(plan).to(device)  # [B, K+1]
    parents = parents.to(device)  # [B, K+1]
    if rows is not None:
        keep = torch.tensor(rows, device=device)
        tokens, parents, target = tokens[keep], parents[keep], target[keep]
    return tree_accept(tokens, parents, target)


def _root_and_drafts(plan: DraftPlan) -> torch.Tensor:
    """[B, K+1] node tokens for ``tree_accept`` (the root's, never compared, as 0)."""
    return plan.node_tokens(0)


def _uniforms(srows: list[Row], parents: torch.Tensor) -> np.ndarray:
    """[Bs, K+1] the uniform behind each node's sample: its row's position-keyed uniform at the
    output position the node's token would take (same depth, same uniform)."""
    depth = tree_depths(parents).cpu().numpy()  # [Bs, K+1]
    first = np.array([r.num_output for r in srows], dtype=np.int64)[:, None]
    return position_uniforms([r.seed for r in srows], first + depth)


def logit_rows(out) -> tuple[torch.Tensor, torch.Tensor]:
    """The verify forward's logits as a matrix [R, V] and each node's row in it [B, K+1] (-1 for a
    padded node): the real inputs' logits as the forward returned them when it skipped padding,
    else its [B, K+1, V] logits flattened. Readers index rows instead of copying a padded view."""
    real_logits = getattr(out, "real_logits", None)
    if real_logits is not None:
        return real_logits, out.real_rows  # [N, V], [B, K+1]
    logits = out.logits  # [B, K+1, V]
    b, k1, vocab = logits.shape
    return logits.reshape(b * k1, vocab), _row_major(b, k1)


@functools.lru_cache(maxsize=256)
def _row_major(b: int, k1: int) -> torch.Tensor:
    """[B, K+1] each node's row of a [B, K+1, V] forward's logits flattened: one shared, read-only
    table per shape (every step calls ``logit_rows`` twice; a torch.arange + view after the forward
    cost ~40 us each on its cold caches)."""
    return torch.arange(b * k1).view(b, k1)


def trace_topk(rows: list[Row], plan: DraftPlan, logits: torch.Tensor, view_rows: torch.Tensor,
               top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """Target top-k (ids, log-probs) [B, K+1, T] at the verified positions of rows that are traced.

    ``logits`` [R, V] and ``view_rows`` [B, K+1]: the row of ``logits`` at each position of
    ``plan`` (see ``logit_rows``). Only positions j <= num_drafted of rows with ``train`` set are
    computed (kernels.topk_logprobs reads those rows in place: one read of each on the CPU); the
    rest stay padded (-1 / -inf). On the CPU one native call writes both arrays: at batch 1 the
    masks, gathers and fills around the top-k cost ~0.2 ms on the step's cold caches in torch ops
    (more than the top-k itself, ~1.5 % of a step), ~0.1 ms in numpy ones."""
    b, k1 = view_rows.shape
    t = min(top_k, logits.shape[-1])
    lengths = plan.lengths.numpy()  # [B]
    traced = np.fromiter((r.request.train for r in rows), dtype=bool, count=b)  # [B]
    node_rows = view_rows.cpu().numpy()  # [B, K+1]
    native = topk_logprobs_padded(logits, t, node_rows, lengths, traced)
    if native is not None:
        return native
    keep = (np.arange(k1)[None, :] <= lengths[:, None]) & traced[:, None]  # [B, K+1]
    ids, lp = topk_logprobs(logits, t, rows=torch.from_numpy(node_rows[keep].astype(np.int64)))  # [N, T]
    topk_ids = np.full((b, k1, t), -1, dtype=np.int32)
    topk_lp = np.full((b, k1, t), -np.inf, dtype=np.float16)
    topk_ids[keep] = ids.cpu().numpy()
    topk_lp[keep] = lp.cpu().numpy()
    return topk_ids, topk_lp


def path_features(feats: torch.Tensor | None, plan: DraftPlan, path: torch.Tensor) -> torch.Tensor | None:
    """The forward's feature rows [B, K+1, F] in the order a row emits them: a tree step's along
    each row's accepted path (``path`` [B, K+1] node indices, -1 past its end) first."""
    if feats is None or not plan.is_tree():
        return feats
    index = path.clamp(min=0).to(feats.device)
    return feats.gather(1, index[:, :, None].expand(-1, -1, feats.shape[-1]))  # [B, K+1, F]


def step_report(
    rows: list[Row],
    plan: DraftPlan,
    parents: torch.Tensor,
    paths: list[list[int]],
    out,
    emitted: list[list[int]],
    num_accepted: list[int],
    feats: torch.Tensor | None,
    draft_s: float,
    verify_s: float,
    *,
    top_k: int | None,
    drafter_version: str,
    feature_layers: tuple[int, ...],
) -> tuple[VerifyBatch, np.ndarray]:
    """The step as observers see it (numpy, CPU), and the acceptance trials along each row's view
    (what the speculation policy observes). A tree step is reported as its linear view
    (``tree.linear_view``: the accepted path, then the rejected node that ended it) with the tree
    itself in the ``tree_*`` fields. ``top_k``: trace the target's top-k at the view's positions of
    traced rows (None: no observer wants it); the logits are then read as rows of the forward's
    own, not a copy."""
    view, view_nodes, tried = linear_view(plan, parents, paths)
    lengths = view.lengths.numpy()
    in_len = np.arange(view.k)[None, :] < lengths[:, None]  # [B, K']
    topk_ids = topk_lp = trace_ms = None
    if top_k is not None and any(r.request.train for r in rows):
        t0 = time.perf_counter()
        matrix, node_row = logit_rows(out)  # [R, V], the row of each node [B, K+1]
        topk_ids, topk_lp = trace_topk(rows, view, matrix, node_row.gather(1, view_nodes), top_k)
        trace_ms = (time.perf_counter() - t0) * 1e3
    features = None
    if feats is not None:
        bits = feats.to(torch.bfloat16).view(torch.int16).cpu().numpy().view(np.uint16)  # [B, K+1, F]
        features = [bits[b, : a + 1] for b, a in enumerate(num_accepted)]
    report = VerifyBatch(
        request_ids=[r.request_id for r in rows],
        positions=np.array([r.num_output for r in rows], dtype=np.int32),
        num_drafted=lengths.astype(np.int16),
        num_accepted=np.asarray(num_accepted, dtype=np.int16),
        source=view.source,
        draft_ids=np.where(in_len, view.tokens.numpy(), -1).astype(np.int32),
        draft_probs=np.where(in_len, view.probs.numpy(), 0.0).astype(np.float32),
        emitted=emitted,
        target_topk_ids=topk_ids,
        target_topk_logprobs=topk_lp,
        features=features,
        draft_ms=draft_s * 1000.0,
        verify_ms=verify_s * 1000.0,
        trace_ms=trace_ms,
        drafter_version=drafter_version,
        feature_layers=feature_layers if feats is not None else (),
    )
    if plan.is_tree():
        valid = np.arange(plan.k)[None, :] < plan.lengths.numpy()[:, None]  # [B, K]
        report.tree_nodes = plan.lengths.numpy().astype(np.int16)
        report.tree_ids = np.where(valid, plan.tokens.numpy(), -1).astype(np.int32)
        report.tree_parents = np.where(valid, plan.parents.numpy(), -1).astype(np.int16)
    return report, tried
