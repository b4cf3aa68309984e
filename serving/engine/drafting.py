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

from feedback.trace import DrafterKind
from serving.drafters.base import DraftProposal


@dataclass
class DraftPlan:
    tokens: torch.Tensor  # [B, K] int64, 0 beyond lengths
    lengths: torch.Tensor  # [B] int64
    probs: torch.Tensor  # [B, K] float32, q(token); 0 beyond lengths
    source: np.ndarray  # [B] uint8 DrafterKind (NONE where nothing was drafted)
    dists: torch.Tensor | None = None  # [B, K, V] float32 or None (point-mass drafts)

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
    return DraftPlan(tokens, full_lengths, probs, source, dists)
