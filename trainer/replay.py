"""Replay buffer of traces: recency-weighted sampling for training, a held-out split for the gate.

The split is by request (a hash of the request id), never by position: held-out outputs must be
text the student never saw. The held-out set is the most recent ``heldout_size`` held-out traces,
so the gate judges on current traffic. Training samples traces with weight
``0.5 ** (age / half_life)``, age counted in traces arrived since.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import time
from dataclasses import dataclass

import numpy as np

from feedback.bus.trace import TraceRecord
from feedback.target.fingerprint import TargetFingerprint
from trainer.examples import trace_key

log = logging.getLogger(__name__)


def is_heldout(request_id: str, fraction: float) -> bool:
    """Deterministic per-request split (stable across restarts and replicas)."""
    h = int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:8], "big")
    return (h / 2**64) < fraction


@dataclass
class _Entry:
    record: TraceRecord
    seq: int


class ReplayBuffer:
    def __init__(
        self,
        capacity: int = 5000,
        heldout_fraction: float = 0.15,
        heldout_size: int = 64,
        half_life: float = 500.0,
        fingerprint: TargetFingerprint | None = None,
        tenant: str | None = None,
        max_seen: int | None = None,
        min_heldout: int = 8,
        max_age_s: float | None = None,
    ):
        """``max_seen``: request ids / content keys remembered for dedup (default 4 x capacity; older
        ones are forgotten, so memory stays bounded; redelivery happens within a commit window)."""
        self.capacity = capacity
        self.heldout_fraction = heldout_fraction
        self.half_life = half_life
        self.fingerprint = fingerprint
        self.tenant = tenant
        self._train: collections.deque[_Entry] = collections.deque()
        self._heldout: collections.deque[_Entry] = collections.deque(maxlen=heldout_size)
        self._seen_ids: set[str] = set()
        self._seen_keys: set[bytes] = set()
        self._seen_order: collections.deque[str] = collections.deque()
        self._key_order: collections.deque[bytes] = collections.deque()
        self.max_seen = max_seen or 4 * capacity
        self.min_heldout = min_heldout
        self.max_age_s = max_age_s
        """Retention: traces whose request finished longer ago than this are dropped (None = kept
        until displaced by newer ones)."""
        """Until the held-out set has this many traces it keeps at least its fraction of arrivals."""
        self._seq = 0
        self.rejected = collections.Counter()
        """Why records were not added: duplicate | fingerprint | tenant | expired."""
        self._foreign: set[TargetFingerprint] = set()
        """The other targets whose traces arrived (each warned about once)."""
        self.tokens_seen = 0
        """Output tokens of every training trace ever added (the x-axis of the learning curve)."""
        self.focus: dict[str, float] = {}
        """Domain -> sampling boost (the trainer sets it when serving reports a drift there)."""

    def add(self, record: TraceRecord, heldout: bool | None = None) -> bool:
        """Add one trace; False (and counted in ``rejected``) when it is not for us or a duplicate.

        ``heldout`` forces the split (benchmarks with an explicit held-out prompt set); None = by hash.
        """
        if self.fingerprint is not None and not self.fingerprint.matches(record.target):
            self.rejected["fingerprint"] += 1
            if record.target not in self._foreign:  # else a misconfigured trainer idles unexplained
                self._foreign.add(record.target)
                log.warning("traces of target %s are not trained on: this trainer trains for %s",
                            record.target, self.fingerprint)
            return False
        if self.tenant is not None and record.tenant != self.tenant:
            self.rejected["tenant"] += 1
            return False
        if self._expired(record, time.time()):
            self.rejected["expired"] += 1
            return False
        key = trace_key(record)
        if record.request_id in self._seen_ids or key in self._seen_keys:
            self.rejected["duplicate"] += 1
            return False
        self.remember(record.request_id, key)
        self._seq += 1
        entry = _Entry(record, self._seq)
        if heldout is None:
            heldout = is_heldout(record.request_id, self.heldout_fraction) or self._heldout_starved()
        if heldout:
            self._heldout.append(entry)
        else:
            self._train.append(entry)
            self.tokens_seen += len(record.output_ids)
            while len(self._train) > self.capacity:
                self._train.popleft()
        return True

    def _expired(self, record: TraceRecord, now: float) -> bool:
        return self.max_age_s is not None and record.finished_at < now - self.max_age_s

    def expire(self, now: float | None = None) -> int:
        """Drop the traces older than ``max_age_s``; returns how many were dropped."""
        if self.max_age_s is None:
            return 0
        now = time.time() if now is None else now
        return self._drop(lambda r: self._expired(r, now))

    def delete_tenant(self, tenant: str) -> int:
        """Drop every trace of ``tenant`` (a deletion request); returns how many were dropped."""
        return self._drop(lambda r: r.tenant == tenant)

    def _drop(self, doomed) -> int:
        n = 0
        for entries in (self._train, self._heldout):
            kept = [e for e in entries if not doomed(e.record)]
            gone = len(entries) - len(kept)
            if gone:
                entries.clear()
                entries.extend(kept)
                n += gone
        return n

    def _heldout_starved(self) -> bool:
        """The hash split left the held-out set below its share of the first ``min_heldout`` traces
        (a small stream can draw none at all, and the gate then never runs): take this one."""
        if len(self._heldout) >= min(self.min_heldout, self._heldout.maxlen or 0):
            return False
        return len(self._heldout) < int(self.heldout_fraction * self._seq)

    def remember(self, request_id: str, key: bytes | None = None) -> None:
        """Mark a request (and its content key) seen, forgetting the oldest beyond ``max_seen``."""
        if request_id not in self._seen_ids:
            self._seen_ids.add(request_id)
            self._seen_order.append(request_id)
            if len(self._seen_order) > self.max_seen:
                self._seen_ids.discard(self._seen_order.popleft())
        if key is not None and key not in self._seen_keys:
            self._seen_keys.add(key)
            self._key_order.append(key)
            if len(self._key_order) > self.max_seen:
                self._seen_keys.discard(self._key_order.popleft())

    def extend(self, records) -> int:
        return sum(self.add(r) for r in records)

    def __len__(self) -> int:
        return len(self._train)

    @property
    def train_records(self) -> list[TraceRecord]:
        return [e.record for e in self._train]

    @property
    def heldout(self) -> list[TraceRecord]:
        return [e.record for e in self._heldout]

    def weights(self, focus: bool = True) -> np.ndarray:
        """Sampling weight of each training trace, oldest first: recency (newest = 1) times the
        ``focus`` boost of its domain (``focus=False``: recency alone)."""
        seqs = np.array([e.seq for e in self._train], dtype=np.float64)  # [N]
        if seqs.size == 0:
            return seqs
        w = 0.5 ** ((self._seq - seqs) / self.half_life)  # [N]
        if focus and self.focus:
            w = w * np.array([self.focus.get(e.record.domain or "default", 1.0) for e in self._train])
        return w

    def domain_shares(self) -> dict[str, float]:
        """Each domain's share of the recency sampling weight (no focus): what training would
        sample of it. Empty without training traces."""
        w = self.weights(focus=False)  # [N]
        total = float(w.sum())
        shares: dict[str, float] = {}
        for e, wi in zip(self._train, w):
            d = e.record.domain or "default"
            shares[d] = shares.get(d, 0.0) + float(wi) / total
        return shares

    def sample(self, n: int, rng: np.random.Generator) -> list[TraceRecord]:
        """``n`` training traces drawn with probability proportional to recency weight (so the
        recency weighting is in the sampling, not in the loss)."""
        if not self._train:
            return []
        w = self.weights()
        idx = rng.choice(len(w), size=n, replace=len(w) < n, p=w / w.sum())
        return [self._train[i].record for i in idx]
