"""Token-tree helpers of the engine: the node totals a step may verify and the order a node budget
takes a batch's nodes in (``node_totals``, ``best_nodes_first``, for GoodputPolicy's width step),
cutting a draft plan to a node budget, and the chain view of a verified tree that observers and
traces see.

The chain view of row b is its accepted path plus the first rejected child of the path's last node
(the branch the target was verified on and refused): exactly what a chain step with those drafts
would have verified, so the trace schema's meaning (row j of the target top-k is the position after
drafts[:j]) and the trainer's examples hold unchanged for trees. Other rejected branches are not
traced.
"""

from __future__ import annotations

import heapq

import numpy as np
import torch

from serving.engine.drafting import DraftPlan


def trim_plan(plan: DraftPlan, width) -> DraftPlan:
    """The plan's first ``width`` nodes per row (an int for every row, or [B] ints; drafters order
    nodes so that a prefix of them is a subtree, e.g. best-first)."""
    old = plan.lengths.numpy()
    lengths = np.minimum(old, np.maximum(np.asarray(width, dtype=old.dtype), 0))  # [B]
    if np.array_equal(lengths, old):
        return plan
    width = int(lengths.max()) if lengths.size else 0
    if width == 0:
        return DraftPlan.none(plan.tokens.shape[0])
    source = plan.source.copy()
    source[lengths == 0] = 0
    return DraftPlan(
        tokens=plan.tokens[:, :width],
        lengths=torch.from_numpy(lengths),
        probs=plan.probs[:, :width],
        source=source,
        dists=None if plan.dists is None else plan.dists[:, :width],
        parents=None if plan.parents is None else plan.parents[:, :width],
        confidence=None if plan.confidence is None else plan.confidence[:, :width],
    )


def path_confidence(parents: np.ndarray, confidence: np.ndarray) -> np.ndarray:
    """[B, K+1] node-space parents and [B, K] per-node confidences -> [B, K] probability that each
    drafted node is accepted (the product of the confidences on its path)."""
    b, k = confidence.shape
    # Over Python floats (the same float64 products as a numpy recurrence would take, in the same
    # order): ~5 numpy calls a node cost ~0.1 ms a step on the step thread's cold caches.
    conf = confidence.astype(np.float64).tolist()
    out = []
    for row_par, row_conf in zip(parents.tolist(), conf):
        cum = [1.0] * (k + 1)  # node space, root = 1
        for j in range(1, k + 1):
            par = row_par[j]
            cum[j] = cum[par] * min(max(row_conf[j - 1], 0.0), 1.0) if par >= 0 else 0.0
        out.append(cum[1:])
    return np.array(out, dtype=np.float64).reshape(b, k)


def linear_view(
    plan: DraftPlan, parents: torch.Tensor, paths: list[list[int]]
) -> tuple[DraftPlan, torch.Tensor, np.ndarray]:
    """Chain view of a verified step: (plan, nodes [B, K'+1], verified path lengths [B]).

    ``nodes[b, j]``: the node of the step's forward (root 0) that view position j of row b is, so
    that a reader of the target's logits at the view (traces) reads rows of the forward's own
    logits rather than a [B, K'+1, V] copy. For chain plans the view is the plan itself. ``paths``:
    per row, node indices root..last accepted."""
    if not plan.is_tree():
        nodes = torch.arange(plan.k + 1)[None, :].expand(len(paths), -1)  # [B, K+1]
        return plan, nodes, plan.lengths.numpy()
    # Over Python lists: a few dozen values, where each numpy or torch call on a step thread
    # (cold caches after the forward) costs ~10-50 us; with numpy's take_along_axis and masks this
    # was ~11 % of a speculative step's time outside the forward (py-spy, batch 1).
    par = parents.tolist()
    lengths = plan.lengths.tolist()
    chains = []
    for b, path in enumerate(paths):
        last = path[-1]
        rejected = next((i for i in range(1, lengths[b] + 1) if par[b][i] == last), None)
        chains.append(path[1:] if rejected is None else path[1:] + [rejected])
    k = max((len(c) for c in chains), default=0)
    pad = [0] * k
    batch = len(chains)

    def along(t: torch.Tensor, fill, dtype) -> torch.Tensor:  # [B, K] -> [B, K'] at the view's drafts
        values = t.tolist()
        rows = [[values[b][n - 1] for n in c] + [fill] * (k - len(c)) for b, c in enumerate(chains)]
        return torch.from_numpy(np.array(rows, dtype=dtype).reshape(batch, k))

    nodes = np.array([[0] + c + pad[len(c):] for c in chains], dtype=np.int64)  # [B, K'+1]
    tried = np.array([len(c) for c in chains], dtype=np.int64)  # [B]
    view = DraftPlan(
        tokens=along(plan.tokens, 0, np.int64),
        lengths=torch.from_numpy(tried),
        probs=along(plan.probs, 0.0, np.float32),
        source=plan.source,
        confidence=None if plan.confidence is None else along(plan.confidence, 0.0, np.float32),
    )
    return view, torch.from_numpy(nodes.reshape(batch, k + 1)), tried


def node_totals(available: int) -> list[int]:
    """The node totals a step may verify, up to ``available``: every count to 8, then four per
    power of two (10, 12, 14, 16, 20, ...), so that each is measured often enough (VerifyCosts
    keeps a median per total)."""
    out, n = [], 0
    while n <= available:
        out.append(n)
        n += 1 if n < 8 else 1 << (n.bit_length() - 3)
    return out


def best_nodes_first(cum, lengths) -> tuple[list[int], list[float]]:
    """The batch's drafted nodes in the order a budget takes them: each row's nodes in its own
    order (a prefix of them is a subtree), the rows merged by the acceptance probability of their
    next node. ``cum`` [B, K] (rows of floats, or an array), ``lengths`` [B]. Returns each taken
    node's row and probability ([N], [N]), as lists: their reader walks them in Python."""
    lengths = [int(n) for n in lengths]
    heap = [(-float(cum[b][0]), b) for b in range(len(lengths)) if lengths[b] > 0]
    heapq.heapify(heap)
    taken = [0] * len(lengths)
    rows, gains = [], []
    while heap:
        g, b = heapq.heappop(heap)
        rows.append(b)
        gains.append(-g)
        taken[b] += 1
        if taken[b] < lengths[b]:
            heapq.heappush(heap, (-float(cum[b][taken[b]]), b))
    return rows, gains
