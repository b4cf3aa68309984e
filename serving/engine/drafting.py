"""Turning a drafter's proposal for some rows into the batch's draft plan, defensively.

The drafter sees only the rows that may draft this step (room left, drafter accepted them); its
proposal is checked (shapes, lengths, token range) and scattered back into batch-wide tensors. A
malformed proposal loses its drafts, never the request: verification stays lossless whatever the
drafts are.
"""

from __future__ import annotations

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

    def node_parents(self) -> torch.Tensor:
        """[B, K+1] parents in node space (node 0 = the row's last token; draft j = node j + 1;
        -1 for the root and for nodes beyond a row's length)."""
        b, k = self.tokens.shape
        valid = torch.arange(k)[None, :] < self.lengths[:, None]  # [B, K]
        par = torch.arange(k).expand(b, k) if self.parents is None else self.parents + 1  # [B, K]
        par = torch.where(valid, par, -1)
        return torch.cat([torch.full((b, 1), -1, dtype=torch.long), par], dim=1)

    def node_tokens(self, last: torch.Tensor) -> torch.Tensor:
        """[B, K+1] forward inputs: the row's last token [B], then its drafts."""
        return torch.cat([last[:, None], self.tokens], dim=1)

    def is_tree(self) -> bool:
        return self.parents is not None

    @property
    def k(self) -> int:
        return int(self.tokens.shape[1])

    @staticmethod
    def none(batch_size: int) -> DraftPlan:
        return DraftPlan(
            tokens=torch.zeros(batch_size, 0, dtype=torch.long),
            lengths=torch.zeros(batch_size, dtype=torch.long),
            probs=torch.zeros(batch_size, 0, dtype=torch.float32),
            source=np.full(batch_size, DrafterKind.NONE, dtype=np.uint8),
        )


def plan_from_proposal(
    proposal: DraftProposal,
    rows: list[int],
    caps: np.ndarray,
    batch_size: int,
    vocab_size: int,
) -> DraftPlan:
    """``rows``: batch indices the proposal's rows belong to; ``caps`` [B]: most drafts per row."""
    n = len(rows)
    tok = proposal.tokens.detach().to("cpu").long()  # [n, kp]
    if tok.ndim != 2 or tok.shape[0] != n:
        raise ValueError(f"proposal tokens must be [{n}, k], got {tuple(tok.shape)}")
    kp = tok.shape[1]
    idx = torch.as_tensor(rows, dtype=torch.long)  # [n]
    lengths = proposal.lengths.detach().to("cpu").long().reshape(n).clamp(0, kp)  # [n]
    lengths = torch.minimum(lengths, torch.as_tensor(caps[rows], dtype=torch.long))
    bad = (tok < 0) | (tok >= vocab_size)  # [n, kp]
    first_bad = torch.where(bad.any(1), bad.int().argmax(1), kp)  # [n]
    lengths = torch.minimum(lengths, first_bad)
    par = None
    if proposal.parents is not None:
        if proposal.dists is not None:
            raise ValueError("token trees need point-mass drafts (dists must be None)")
        par = proposal.parents.detach().to("cpu").long()  # [n, kp]
        if par.shape != tok.shape:
            raise ValueError(f"proposal parents must be {tuple(tok.shape)}, got {tuple(par.shape)}")
        j = torch.arange(kp)
        bad_par = (par < -1) | (par >= j[None, :])  # [n, kp] a parent must come earlier
        first_bad = torch.where(bad_par.any(1), bad_par.int().argmax(1), kp)  # [n]
        lengths = torch.minimum(lengths, first_bad)
    k = int(lengths.max()) if n else 0
    if k == 0:
        return DraftPlan.none(batch_size)

    in_len = torch.arange(k) < lengths[:, None]  # [n, k]
    tokens = torch.zeros(batch_size, k, dtype=torch.long)
    tokens[idx] = torch.where(in_len, tok[:, :k], 0)
    full_lengths = torch.zeros(batch_size, dtype=torch.long)
    full_lengths[idx] = lengths
    probs = torch.zeros(batch_size, k, dtype=torch.float32)
    q = proposal.probs.detach().to("cpu").float().reshape(n, -1)[:, :k]  # [n, <=k]
    probs[idx, : q.shape[1]] = torch.where(in_len[:, : q.shape[1]], q, 0.0)
    source = np.full(batch_size, DrafterKind.NONE, dtype=np.uint8)
    source[rows] = np.asarray(proposal.source, dtype=np.uint8).reshape(n)
    source[full_lengths.numpy() == 0] = DrafterKind.NONE
    dists = None
    if proposal.dists is not None:
        d = proposal.dists.detach().to("cpu").float()  # [n, kp, V]
        if d.shape[0] != n or d.shape[2] != vocab_size or d.shape[1] < k:
            raise ValueError(
                f"proposal dists must be [{n}, >={k}, {vocab_size}], got {tuple(d.shape)}"
            )
        dists = torch.zeros(batch_size, k, vocab_size, dtype=torch.float32)
        dists[idx] = d[:, :k]
    parents = None
    if par is not None:
        chain = torch.arange(k)[None, :] - 1  # [1, k]
        parents = chain.expand(batch_size, k).clone()
        parents[idx] = torch.where(in_len, par[:, :k], chain)
    confidence = None
    if proposal.confidence is not None:
        c = proposal.confidence.detach().to("cpu").float().reshape(n, -1)[:, :k]  # [n, <=k]
        confidence = torch.zeros(batch_size, k, dtype=torch.float32)
        confidence[idx, : c.shape[1]] = torch.where(in_len[:, : c.shape[1]], c, 0.0)
    return DraftPlan(tokens, full_lengths, probs, source, dists, parents, confidence)
