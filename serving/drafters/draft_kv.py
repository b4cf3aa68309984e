"""The per-request KV caches of the learned drafters and their batched layout.

Per request the drafter keeps a KV buffer per draft layer ([kv_heads, capacity, head_dim], grown by
doubling) holding only *committed* positions, plus the *pending* inputs committed by the target
since its last draft (``RowState``). A batch of several rows works on a padded copy of the rows'
caches: committed part, then one shared column block for the new positions, masked per row
(``Layout``), written through HF's ``update(key, value, layer_idx)`` signature (``BatchKV``).
Used by serving/drafters/learned.py, which drafts over them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


class BatchKV:
    """A cache with HF's ``update(key, value, layer_idx)`` signature writing at a shared cursor."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], start: int):
        self.keys, self.values = keys, values  # per layer [B, kvh, cap, hd]
        self.length = start

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        end = self.length + key.shape[2]
        self.keys[layer_idx][:, :, self.length : end] = key
        self.values[layer_idx][:, :, self.length : end] = value
        return self.keys[layer_idx][:, :, :end], self.values[layer_idx][:, :, :end]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def advance(self, n: int) -> None:
        self.length += n


@dataclass
class RowState:
    """Draft state of one request."""

    keys: list[torch.Tensor]  # per layer [kvh, cap, hd]
    values: list[torch.Tensor]
    length: int = 0
    """committed draft positions (cache columns)"""
    skipped: int = 0
    """context tokens never committed (``LearnedDrafter.max_catch_up``): the rotary position of a
    column committed now is its index plus this, so positions stay those of the request"""
    pending_tokens: list[int] = field(default_factory=list)
    pending_features: list[torch.Tensor] = field(default_factory=list)  # each [m, F]
    last_hidden: torch.Tensor | None = None
    """[H] output at the last committed position: the first draft token's distribution comes
    from it, and (eagle) it is the hidden state fed to the first draft step."""

    @property
    def num_pending(self) -> int:
        return len(self.pending_tokens)

    @property
    def can_draft(self) -> bool:
        return self.num_pending > 0 or self.last_hidden is not None

    def skip_stale(self, keep: int) -> None:
        """Drop all but the last ``keep`` pending inputs (their features with them), counting
        them as ``skipped``."""
        excess = self.num_pending - keep
        if excess <= 0:
            return
        del self.pending_tokens[:excess]
        if self.pending_features:
            kept = torch.cat(self.pending_features)[excess:]  # [keep, F]
            self.pending_features = [kept] if kept.shape[0] else []
        self.skipped += excess

    def hold_last(self) -> tuple[int, torch.Tensor | None]:
        """Take the last pending input (and its feature row, [1, F] or None) out of the pending
        list; ``pend`` puts it back."""
        token = self.pending_tokens.pop()
        feature = None
        if self.pending_features:
            feats = torch.cat(self.pending_features)  # [n, F]
            feature = feats[-1:]
            self.pending_features = [feats[:-1]] if feats.shape[0] > 1 else []
        return token, feature

    def pend(self, tokens: list[int], features: torch.Tensor | None) -> None:
        """Queue inputs committed by the target (``features`` [len(tokens), F] or None)."""
        self.pending_tokens.extend(int(t) for t in tokens)
        if features is not None and features.shape[0]:
            self.pending_features.append(features)

    def reserve(self, needed: int) -> None:
        """Grow the KV buffers (by doubling) to hold at least ``needed`` columns."""
        cap = self.keys[0].shape[1]
        if needed <= cap:
            return
        while cap < needed:
            cap *= 2
        for buf in (self.keys, self.values):
            for i, old in enumerate(buf):
                new = old.new_zeros(old.shape[0], cap, old.shape[2])  # [kvh, cap, hd]
                new[:, : self.length] = old[:, : self.length]
                buf[i] = new


@dataclass
class Layout:
    """Column layout of a batched cache: [0, base) committed (row i valid below lengths[i]), then
    new positions: the extend block [base, base+M) (row i valid below pending[i]), then draft steps.
    The masks are made in numpy: a draft step runs right after a target forward has flushed the
    CPU caches, where each small torch op costs 20-40 us (ARCHITECTURE.md, "The step's Python
    runs on cold caches")."""

    lengths: np.ndarray  # [B] int64
    pending: np.ndarray  # [B] int64
    base: int
    block: int  # M
    valid: np.ndarray  # [B, cols] bool
    new_index: np.ndarray  # [cols] -1 for committed columns, else position in the new block
    positions: np.ndarray  # [B] rotary position of each row's first new input

    @classmethod
    def build(cls, lengths: np.ndarray, pending: np.ndarray, skipped: np.ndarray, extra: int) -> Layout:
        n, m = lengths, pending
        base, block = int(n.max()), int(m.max())
        cols = np.arange(base + block + extra)  # [C]
        j = cols - base  # [C]
        committed = cols[None, :] < n[:, None]  # [B, C]
        new_valid = (j[None, :] >= 0) & ((j[None, :] < m[:, None]) | (j[None, :] >= block))  # [B, C]
        new_index = np.where(j >= 0, j, -1)  # [C]
        return cls(n, m, base, block, committed | new_valid, new_index, n + skipped)

    def mask(self, first_query: int, num_queries: int) -> torch.Tensor:
        """[B, 1, Lq, Lk] bool for queries at new-block indices first_query.. (causal within the block)."""
        lk = self.base + first_query + num_queries
        q = np.arange(first_query, first_query + num_queries)  # [Lq]
        causal = self.new_index[None, :lk] <= q[:, None]  # [Lq, Lk]
        return torch.from_numpy(self.valid[:, None, None, :lk] & causal[None, None])  # [B, 1, Lq, Lk]
