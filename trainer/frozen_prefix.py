"""The frozen layers' output of a self-speculative student, computed once per sequence.

A selfspec student is the target's embeddings and first E decoder layers (frozen: they are the
target's own tensors) under a small trainable adapter (feedback/drafters/from_target.py). The
trainer replays the same traces many times, in training steps and in held-out evaluations, and
every pass ran those frozen layers again over the same tokens. Their output at a token depends only
on the sequence it sits in (its tokens, positions and attention pattern) and on the autocast state,
so it is kept here per sequence, and a step or an evaluation runs only the adapter, the norm and
the lm_head.

A packed training sequence (trainer/packing.py: a main sequence with its discarded branches as
tails) holds one request's examples only, so its frozen output does not depend on the other
sequences of a batch: right padding is never attended to. Entries are kept least recently used
first out, within ``max_bytes``; copies of a student (the gate's champions) share the cache, since
no copy trains the frozen layers.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np
import torch

from trainer.packing import PackedSequence

DEFAULT_MAX_BYTES = 256 << 20
"""~110k tokens of a 576-wide model in fp32: the replay window of a few hundred requests."""


def sequence_key(seq: PackedSequence) -> bytes:
    """What a sequence's frozen output depends on (besides the frozen weights and autocast)."""
    h = hashlib.blake2b(digest_size=16)
    for a in (seq.tokens, seq.positions, seq.sees_main, seq.branch):
        h.update(np.ascontiguousarray(a, dtype=np.int64).tobytes())
        h.update(b"|")
    h.update(str(seq.main_len).encode())
    return h.digest()


class FrozenPrefixCache:
    """Per-sequence outputs of a student's frozen layers: ``[n, H]`` tensors, LRU within a byte budget."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES):
        self.max_bytes = int(max_bytes)
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self._store: OrderedDict[tuple, torch.Tensor] = OrderedDict()

    def __deepcopy__(self, memo) -> FrozenPrefixCache:
        return self  # copies of a student share the frozen layers' values, so their outputs too

    def __len__(self) -> int:
        return len(self._store)

    def outputs(self, seqs: Sequence[PackedSequence],
                compute: Callable[[list[PackedSequence]], torch.Tensor]) -> list[torch.Tensor]:
        """The frozen output ``[len(seq.tokens), H]`` of each sequence; ``compute(missing)`` runs the
        frozen layers over those not kept (``[M, L, H]``, right-padded) once for all of them."""
        autocast = torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda")
        keys = [(sequence_key(s), autocast) for s in seqs]
        out: list[torch.Tensor | None] = [self._get(k) for k in keys]
        missing = [i for i, h in enumerate(out) if h is None]
        self.hits += len(seqs) - len(missing)
        self.misses += len(missing)
        if missing:
            with torch.no_grad():
                hidden = compute([seqs[i] for i in missing])  # [M, L, H]
            for j, i in enumerate(missing):
                out[i] = hidden[j, : len(seqs[i].tokens)].detach().clone()  # [n_i, H], not a view of the batch
                self._put(keys[i], out[i])
        return out  # type: ignore[return-value]

    def _get(self, key: tuple) -> torch.Tensor | None:
        h = self._store.get(key)
        if h is not None:
            self._store.move_to_end(key)
        return h

    def _put(self, key: tuple, h: torch.Tensor) -> None:
        size = h.numel() * h.element_size()
        if size > self.max_bytes or key in self._store:
            return
        self._store[key] = h
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, old = self._store.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()


def padded(rows: list[torch.Tensor]) -> torch.Tensor:
    """[n_i, H] per sequence -> [B, L, H], zeros after each sequence's end (padding attends only to
    itself and is never attended to, so its values reach no row)."""
    L = max(r.shape[0] for r in rows)
    out = rows[0].new_zeros(len(rows), L, rows[0].shape[-1])
    for b, r in enumerate(rows):
        out[b, : r.shape[0]] = r
    return out
