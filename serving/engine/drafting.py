"""Turning a drafter's proposal for some rows into the batch's draft plan, defensively.

The drafter sees only the rows that may draft this step (room left, drafter accepted them); its
proposal is checked (shapes, lengths, token range) and scattered back into batch-wide tensors. A
malformed proposal loses its drafts, never the request: verification stays lossless whatever the
drafts are.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from feedback.bus.trace import DrafterKind
from serving.drafters.base import DraftProposal


@dataclass
class DraftPlan:
    tokens: torch.Tensor  # [B, K] int64, 0 beyond lengths
    lengths: torch.Tensor  # [B] int64
    probs: torch.Tensor  # [B, K] float32, q(token); 0 beyond lengths
    source: np.ndarray  # [B] uint8 DrafterKind (NONE where nothing was drafted)
    dists: torch.Tensor | None = None  # [B, K, V] float32 or None (point-mass drafts)
    parents: torch.Tensor | None = None  # [B, K] int64 draft-index parents (-1 root) or None (chains)
    confidence: torch.Tensor | None = None  # [B, K] float32 per-node acceptance estimate or None
    catch_up_ms: float = 0.0  # the drafter's time committing backlogs (DraftProposal.catch_up_ms)

    def node_parents(self) -> torch.Tensor:
        """[B, K+1] parents in node space (node 0 = the row's last token; draft j = node j + 1;
        -1 for the root and for nodes beyond a row's length)."""
        b, k = self.tokens.shape  # numpy: torch's ops on these few values cost ~10x
        valid = np.arange(k)[None, :] < self.lengths.numpy()[:, None]  # [B, K]
        par = np.arange(k)[None, :] if self.parents is None else self.parents.numpy() + 1  # [B, K]
        out = np.full((b, k + 1), -1, dtype=np.int64)
        out[:, 1:] = np.where(valid, par, -1)
        return torch.from_numpy(out)

    def node_tokens(self, last) -> torch.Tensor:
        """[B, K+1] forward inputs: the row's last token ([B] ints), then its drafts. Written into
        one numpy array: torch.tensor + torch.cat on a step thread's cold caches took ~0.2 ms."""
        out = np.empty((self.tokens.shape[0], self.k + 1), dtype=np.int64)  # [B, K+1]
        out[:, 0] = last
        out[:, 1:] = self.tokens.numpy()
        return torch.from_numpy(out)

    def is_tree(self) -> bool:
        return self.parents is not None

    @property
    def k(self) -> int:
        return int(self.tokens.shape[1])

    @staticmethod
    def none(batch_size: int) -> DraftPlan:
        """The plan of a plain step: one shared, read-only plan per batch size. A plain step
        follows a target forward, which leaves the CPU caches cold, and there its three small
        tensor allocations took ~0.13-0.25 ms (1-2 % of a step) every step a drafter sat out."""
        return _no_drafts(batch_size)


@functools.lru_cache(maxsize=64)
def _no_drafts(batch_size: int) -> DraftPlan:
    source = np.full(batch_size, DrafterKind.NONE, dtype=np.uint8)
    source.setflags(write=False)
    return DraftPlan(
        tokens=torch.zeros(batch_size, 0, dtype=torch.long),
        lengths=torch.zeros(batch_size, dtype=torch.long),
        probs=torch.zeros(batch_size, 0, dtype=torch.float32),
        source=source,
    )


def plan_from_proposal(
    proposal: DraftProposal,
    rows: list[int],
    caps: np.ndarray,
    batch_size: int,
    vocab_size: int,
    max_nodes: int | None = None,
) -> DraftPlan:
    """``rows``: batch indices the proposal's rows belong to; ``caps`` [B]: the deepest draft per
    row (a tree's node at depth d emits at most d + 1 tokens); ``max_nodes``: most drafted nodes
    per row (None: ``caps``), the verify width the engine was built for.

    Checked row by row over Python lists and written into numpy arrays once: these are a few
    dozen values. ~40 small torch ops took ~0.6 ms of every speculative step on a 2-core Xeon, and
    ~35 small numpy ops still ~10 % of a step's time outside the forward on a 2-core EPYC (py-spy,
    batch 1: each numpy call costs tens of microseconds on the step thread's cold caches)."""
    n = len(rows)
    tok = _host(proposal.tokens).astype(np.int64, copy=False)  # [n, kp]
    if tok.ndim != 2 or tok.shape[0] != n:
        raise ValueError(f"proposal tokens must be [{n}, k], got {tuple(tok.shape)}")
    kp = tok.shape[1]
    tokens_in = tok.tolist()
    asked = _host(proposal.lengths).astype(np.int64).reshape(n).tolist()  # [n]
    row_caps = [int(caps[r]) for r in rows]  # [n]
    par_in = None
    if proposal.parents is not None:
        if proposal.dists is not None:
            raise ValueError("token trees need point-mass drafts (dists must be None)")
        par = _host(proposal.parents).astype(np.int64, copy=False)  # [n, kp]
        if par.shape != tok.shape:
            raise ValueError(f"proposal parents must be {tuple(tok.shape)}, got {tuple(par.shape)}")
        par_in = par.tolist()
    lengths = []  # [n] each row's drafts that pass every check, in order
    for i in range(n):
        cap = row_caps[i]
        limit = min(max(asked[i], 0), kp, cap if max_nodes is None else max_nodes)
        row, parents_i = tokens_in[i], None if par_in is None else par_in[i]
        depth = [0] * (limit + 1)  # node space: the root, then the drafts kept so far
        kept = 0
        while kept < limit:
            t = row[kept]
            if t < 0 or t >= vocab_size:
                break  # a token out of range, and everything after it
            if parents_i is None:
                d = kept + 1  # a chain's
            else:
                p = parents_i[kept]
                if p < -1 or p >= kept:
                    break  # a parent must come earlier
                d = depth[p + 1] + 1
            if d > cap:
                break  # a row never drafts past what it may emit (a node at depth d emits d + 1)
            depth[kept + 1] = d
            kept += 1
        lengths.append(kept)
    k = max(lengths, default=0)
    if k == 0:
        return DraftPlan.none(batch_size)

    full_lengths = np.zeros(batch_size, dtype=np.int64)
    full_lengths[rows] = lengths
    source = np.full(batch_size, DrafterKind.NONE, dtype=np.uint8)
    source[rows] = np.asarray(proposal.source, dtype=np.uint8).reshape(n)
    source[full_lengths == 0] = DrafterKind.NONE
    dists = None
    if proposal.dists is not None:
        d = proposal.dists.detach().to("cpu").float()  # [n, kp, V]
        if d.shape[0] != n or d.shape[2] != vocab_size or d.shape[1] < k:
            raise ValueError(
                f"proposal dists must be [{n}, >={k}, {vocab_size}], got {tuple(d.shape)}"
            )
        dists = torch.zeros(batch_size, k, vocab_size, dtype=torch.float32)
        dists[torch.tensor(rows, dtype=torch.long)] = d[:, :k]
    parents = None
    if par_in is not None:  # beyond a row's nodes (and in rows that drafted nothing): a chain
        parents = _scatter(par_in, rows, lengths, batch_size, list(range(-1, k - 1)), np.int64)
    confidence = None
    if proposal.confidence is not None:
        confidence = _scatter(_floats(proposal.confidence, n), rows, lengths, batch_size, [0.0] * k,
                              np.float32)
    return DraftPlan(_scatter(tokens_in, rows, lengths, batch_size, [0] * k, np.int64),
                     torch.from_numpy(full_lengths),
                     _scatter(_floats(proposal.probs, n), rows, lengths, batch_size, [0.0] * k, np.float32),
                     source, dists, parents, confidence, float(proposal.catch_up_ms))


def _scatter(given: list[list], rows: list[int], lengths: list[int], batch_size: int, fill: list,
             dtype) -> torch.Tensor:
    """[B, len(fill)]: every row ``fill``, but row ``rows[i]`` starts with the first ``lengths[i]``
    values of ``given[i]`` (fewer where that row of the proposal is narrower)."""
    out = [list(fill) for _ in range(batch_size)]
    for r, row, n_i in zip(rows, given, lengths):
        m = min(n_i, len(row))
        out[r][:m] = row[:m]
    return torch.from_numpy(np.array(out, dtype=dtype).reshape(batch_size, len(fill)))


def _floats(values, n: int) -> list[list[float]]:
    """A proposal's probs or confidences as n lists of float32 values (any width)."""
    return _host(values).astype(np.float32, copy=False).reshape(n, -1).tolist()


def _host(t) -> np.ndarray:
    """A proposal's tensor (or array) as a numpy array on the host (torch calls only where needed:
    each costs tens of microseconds on a step thread's cold caches)."""
    if isinstance(t, torch.Tensor):
        if t.requires_grad:
            t = t.detach()
        if t.dtype == torch.bfloat16:
            t = t.float()
        if t.device.type != "cpu":
            t = t.cpu()
        return t.numpy()
    return np.asarray(t)


