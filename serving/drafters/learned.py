"""Shared machinery of the learned drafters (eagle, standalone): per-request draft KV caches,
batched drafting over rows of different lengths, draft sampling.

Per request the drafter keeps a KV buffer per draft layer ([kv_heads, capacity, head_dim], grown by
doubling) holding only *committed* positions (real tokens / real target features), plus the
*pending* inputs committed by the target since the last draft (``on_verified`` only appends them;
no model work happens there). ``propose`` runs, for the whole batch:

    extend : one forward over every row's pending inputs (padded to the longest), committing them
    draft  : k - 1 single-position forwards on the drafter's own tokens (and, for eagle, its own
             output hidden states), k lm_head reads; the chain, or a tree of each position's
             ``branches`` most likely tokens along it (serving/drafters/draft_tree.py)

Speculative positions are written past the committed length and simply forgotten: rolling back a
rejected draft costs nothing, and the next extend overwrites them. A batch of several rows works on
a padded copy of the rows' caches (committed part, then one shared column block for the new
positions, masked per row); a single row works in its own buffer with no copy. The caches and
their layout are serving/drafters/draft_kv.py.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

import numpy as np
import torch

from feedback.bus.trace import DrafterKind
from feedback.goodput import LEARNED_BRANCHES
from feedback.registry.artifact_keys import DAY0_VERSION
from serving.drafters.base import DraftProposal, DraftRequestView, chain_parents
from serving.drafters.chained import chained_draft
from serving.drafters.draft_kv import BatchKV, Layout, RowState
from serving.drafters.draft_tree import best_first_tree

log = logging.getLogger(__name__)


class DraftNet(Protocol):
    """What the batched drafting loop needs from a model."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    dtype: torch.dtype
    kv_dtype: torch.dtype
    """What its KV cache buffers hold (bf16 where its attention reads bf16 operands)."""
    target_vocab_size: int
    vocab_map: torch.Tensor | None
    """[Vd] target id of each draft id, or None when the draft vocabulary is the target's."""

    def extend(self, tokens, features, positions, cache, mask) -> torch.Tensor:
        """tokens [B, M], features [B, M, F] or None -> pre-norm hidden [B, M, H]."""
        ...

    def step(self, tokens, hidden, positions, cache, mask) -> torch.Tensor:
        """tokens [B, 1], hidden [B, 1, H] (the previous output) -> [B, 1, H]."""
        ...

    def logits(self, hidden) -> torch.Tensor:
        """[B, H] -> [B, Vd]."""
        ...


class LearnedDrafter:
    """Drafter protocol over a DraftNet; subclasses set ``kind`` and define ``_pending_inputs``."""

    kind = "learned"
    source_kind = DrafterKind.NONE
    feature_layers: tuple[int, ...] = ()
    prior_acceptance: float | None = None
    """The held-out acceptance the artifact was promoted with (None: unmeasured, e.g. a day-0
    copy): where serving's acceptance estimate for this drafter starts."""
    prior_relative: float | None = None
    """The artifact's held-out acceptance over its predecessor's (the trainer's gate scored both on
    the same traces): a successor's estimate starts at its predecessor's live one times this
    (``AcceptanceEstimate.successor``). None: not recorded."""
    flush_threshold = 32
    """Rows with more pending inputs than this are extended alone first (no padding waste)."""
    max_catch_up: int | None = 64
    """A draft commits at most this many of a row's pending inputs, the latest: after a long gap
    (a probe of a drafter that is off, a new request's prompt, the hybrid's exploration) it reads
    the recent context, as a sliding window would, rather than catching up on everything it
    skipped. Catching up cost ~0.13 ms a token for a 3-layer drafter on a 2-core CPU, 1.1 % of a
    target step, so probes that caught up on their whole gap broke the 1 % probe budget whatever
    their spacing (a day-0 selfspec probe after 50 steps of a code request: 41-46 ms). None: every
    committed token. Preparing a row for a swap (``prepare_request``, off the step thread) commits
    the same latest inputs: the whole history of a 2,000-token row took 219-232 ms for a one-layer
    standalone drafter and 407-474 ms for two on 2 cores, work that competes with serving's step
    during the swap, where the same drafter would read only the latest inputs had it started with
    the request."""

    branches: int = LEARNED_BRANCHES
    """Candidates per drafted position (feedback/goodput.py). Above 1, a batch of greedy rows gets
    token trees for the same forwards as a chain: each position's most likely tokens as siblings
    under the chain's previous node, best-first (serving/drafters/draft_tree.py), and the engine's
    width step keeps the nodes that pay. A batch with sampled rows drafts chains (rejection
    sampling with the draft's distributions verifies chains)."""

    def __init__(self, net: DraftNet, version: str = DAY0_VERSION):
        self.net = net
        self.version = version
        self._states: dict[str, RowState] = {}

    # -- protocol -----------------------------------------------------------------------------

    def add_request(self, view: DraftRequestView, features: torch.Tensor | None = None) -> None:
        state = self._new_state()
        tokens, feats = self._initial_inputs(view, features)
        self._append(state, tokens, feats)
        self._states[view.request_id] = state

    @torch.no_grad()
    def prepare_request(self, view: DraftRequestView, features: torch.Tensor | None = None) -> None:
        """add_request, then commit the history now (one extend of this row alone) rather than at
        the next propose: a hot swap calls this off the step thread (PreparableDrafter). Its
        latest ``max_catch_up`` inputs, as a propose would commit."""
        state = self._new_state()
        tokens, feats = self._initial_inputs(view, features)
        self._append(state, tokens, feats)
        if self.max_catch_up is not None:
            state.skip_stale(self.max_catch_up)
        if state.num_pending:
            self._extend([state], extra=0)
        self._states[view.request_id] = state

    def on_verified(
        self, request_id: str, accepted_ids: list[int], features: torch.Tensor | None
    ) -> None:
        state = self._states.get(request_id)
        if state is None:
            raise KeyError(f"{self.kind} drafter: on_verified for unknown request {request_id!r}")
        if accepted_ids:
            self._append(
                state, list(accepted_ids), self._check_features(features, len(accepted_ids))
            )

    def remove_request(self, request_id: str, output_ids: list[int] | None) -> None:
        self._states.pop(request_id, None)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._states

    @torch.no_grad()
    def propose(self, views: list[DraftRequestView], k: int) -> DraftProposal:
        t0 = time.perf_counter()
        batch = len(views)
        if k <= 0 or batch == 0:
            return DraftProposal.empty(batch, max(k, 0))
        states = []
        for v in views:
            if v.request_id not in self._states:
                raise KeyError(
                    f"{self.kind} drafter: propose for request {v.request_id!r} never add_request'ed"
                )
            states.append(self._states[v.request_id])
        if self.max_catch_up is not None:  # a row with nothing pending (that cannot draft) keeps all
            for s in states:
                s.skip_stale(self.max_catch_up)
        # the common case, one greedy row, in one native call where the net has one
        drafted = chained_draft(self.net, states[0], views[0], k, self.branches, k + 1) if batch == 1 else None
        catch_up_ms = 0.0
        if drafted is not None:
            active = [0]
        else:
            active = [i for i, s in enumerate(states) if s.can_draft]
            if not active:
                out = DraftProposal.empty(batch, k)
                out.draft_ms = (time.perf_counter() - t0) * 1e3
                return out
            rows = [states[i] for i in active]
            backlog = [s for s in rows if s.num_pending > k + 1]
            if backlog:
                t_catch = time.perf_counter()
                self._catch_up(backlog)
                catch_up_ms = (time.perf_counter() - t_catch) * 1e3
            cache, layout, last = self._extend(rows, extra=k - 1)
            drafted = self._draft(cache, layout, last, [views[i] for i in active], k)
        tokens, probs, dists, parents = drafted
        n = tokens.shape[1]  # nodes per drafting row: k for chains, k x branches for trees

        if len(active) == batch:  # every row drafted: the proposal is the draft as it is
            out = DraftProposal(
                tokens=tokens, lengths=torch.full((batch,), n, dtype=torch.long), probs=probs,
                source=np.full(batch, self.source_kind, dtype=np.uint8), dists=dists,
                parents=parents,
            )
            out.confidence = probs.clone()
        else:
            out = DraftProposal.empty(batch, n)
            idx = torch.tensor(active)
            out.tokens[idx] = tokens
            out.probs[idx] = probs
            out.lengths[idx] = n
            out.source[active] = np.uint8(self.source_kind)
            if parents is not None:  # rows that did not draft keep chain parents (length 0)
                out.parents = chain_parents(batch, n)  # [B, n]
                out.parents[idx] = parents
            out.confidence = out.probs.clone()
            out.confidence[out.lengths == 0] = 0.0
            if dists is not None:
                full = torch.zeros(batch, n, dists.shape[-1], dtype=dists.dtype)
                full[idx] = dists
                out.dists = full
        out.draft_ms = (time.perf_counter() - t0) * 1e3
        out.catch_up_ms = catch_up_ms
        return out

    # -- inputs -------------------------------------------------------------------------------

    def _initial_inputs(self, view: DraftRequestView, features: torch.Tensor | None):
        """(tokens, features or None) to commit for a new request's history."""
        raise NotImplementedError

    def _check_features(self, features: torch.Tensor | None, n: int) -> torch.Tensor | None:
        return None

    def _catch_up(self, rows: list[RowState]) -> None:
        """Commit all but the last pending input of each row, apart from the draft's own extend:
        a row that drafts every step has at most k + 1 inputs pending (what one verify commits),
        and what a probe or a first draft after a gap pays beyond that is timed apart
        (``DraftProposal.catch_up_ms``). Rows with more than ``flush_threshold`` go alone (no
        padding waste)."""
        held = [s.hold_last() for s in rows]
        alone = [s for s in rows if s.num_pending > self.flush_threshold] if len(rows) > 1 else []
        for s in alone:
            self._extend([s], extra=0)
        rest = [s for s in rows if s.num_pending]
        if rest:
            self._extend(rest, extra=0)
        for s, (token, feature) in zip(rows, held):
            s.pend([token], feature)

    def _append(self, state: RowState, tokens: list[int], features: torch.Tensor | None) -> None:
        state.pend(tokens, None if features is None else features.detach().to("cpu", self.net.dtype))

    # -- caches -------------------------------------------------------------------------------

    def _new_state(self, capacity: int = 64) -> RowState:
        shape = (self.net.num_kv_heads, capacity, self.net.head_dim)
        keys = [torch.zeros(shape, dtype=self.net.kv_dtype) for _ in range(self.net.num_layers)]
        values = [torch.zeros(shape, dtype=self.net.kv_dtype) for _ in range(self.net.num_layers)]
        return RowState(keys, values)

    def _gather(self, rows: list[RowState], layout: Layout, extra: int) -> BatchKV:
        cols = layout.base + layout.block + extra
        if len(rows) == 1:  # work in the row's own buffer: base == its length
            rows[0].reserve(cols)
            return BatchKV(
                [k[None] for k in rows[0].keys], [v[None] for v in rows[0].values], layout.base
            )
        keys, values = [], []
        for layer in range(self.net.num_layers):
            kb = (
                rows[0]
                .keys[layer]
                .new_zeros(len(rows), self.net.num_kv_heads, cols, self.net.head_dim)
            )
            vb = torch.zeros_like(kb)  # [B, kvh, C, hd]
            for i, s in enumerate(rows):
                kb[i, :, : s.length] = s.keys[layer][:, : s.length]
                vb[i, :, : s.length] = s.values[layer][:, : s.length]
            keys.append(kb)
            values.append(vb)
        return BatchKV(keys, values, layout.base)

    def _extend(self, rows: list[RowState], extra: int):
        """Commit every row's pending inputs; return (cache, layout, last hidden [B, H])."""
        # numpy and lists for the bookkeeping: this runs right after a target forward, on cold
        # caches, where each small torch op costs 20-40 us
        lengths = np.array([s.length for s in rows], dtype=np.int64)  # [B]
        pending = np.array([s.num_pending for s in rows], dtype=np.int64)  # [B]
        skipped = np.array([s.skipped for s in rows], dtype=np.int64)  # [B]
        layout = Layout.build(lengths, pending, skipped, extra)
        cache = self._gather(rows, layout, extra)
        block = layout.block
        last = [s.last_hidden for s in rows]
        if block > 0:
            ids = np.zeros((len(rows), block), dtype=np.int64)  # [B, M]
            for i, s in enumerate(rows):
                ids[i, : s.num_pending] = s.pending_tokens
            features = self._pad_features(rows, block)  # [B, M, F] or None
            positions = layout.positions[:, None] + np.arange(block)[None, :]  # [B, M]
            hidden = self.net.extend(
                torch.from_numpy(ids), features, torch.from_numpy(positions), cache, layout.mask(0, block)
            )  # [B, M, H]
            cache.advance(block)
            for i, s in enumerate(rows):
                m = s.num_pending
                if m:
                    last[i] = hidden[i, m - 1].clone()  # not a view: it would keep [B, M, H] alive
                    if len(rows) > 1:
                        s.reserve(s.length + m)
                        for layer in range(self.net.num_layers):
                            s.keys[layer][:, s.length : s.length + m] = cache.keys[layer][
                                i, :, layout.base : layout.base + m
                            ]
                            s.values[layer][:, s.length : s.length + m] = cache.values[layer][
                                i, :, layout.base : layout.base + m
                            ]
                    s.length += m
                    s.pending_tokens.clear()
                    s.pending_features.clear()
                    s.last_hidden = last[i]
        return cache, layout, torch.stack(last)  # last: [B, H]

    def _pad_features(self, rows: list[RowState], block: int) -> torch.Tensor | None:
        return None

    # -- drafting -----------------------------------------------------------------------------

    def _draft(
        self,
        cache: BatchKV,
        layout: Layout,
        last: torch.Tensor,
        views: list[DraftRequestView],
        k: int,
    ):
        """(tokens, probs, dists, parents): a chain of k drafts per row ([B, k]; ``dists`` [B, k,
        V] when some row samples), or, with ``branches`` > 1 and every row greedy, a best-first
        tree of k x branches nodes per row (``parents`` [B, N]; else None)."""
        b = last.shape[0]
        temps = [max(v.temperature, 0.0) for v in views]
        any_sampled = any(t > 0 for t in temps)
        m = 1 if any_sampled else self.branches
        scale = sampled = uniforms = None
        if any_sampled:
            t = torch.tensor(temps, dtype=torch.float32)  # [B]
            sampled = t > 0  # [B]
            scale = torch.where(sampled, t, torch.ones_like(t))[:, None]  # [B, 1]
            uniforms = _uniforms(views, k)  # [B, k]
        vocab_map = self.net.vocab_map
        token_cols, prob_cols = [], []  # per draft position: [B] each ([B, m] for trees)
        qs = []
        positions = layout.positions + layout.pending  # [B] position of the first draft input
        hidden = last[:, None]  # [B, 1, H]
        for j in range(k):
            logits = self.net.logits(hidden[:, 0]).float()  # [B, Vd]
            q = torch.softmax(logits / scale if any_sampled else logits, dim=-1)  # [B, Vd]
            if m > 1:
                top_q, top = q.topk(min(m, q.shape[-1]), dim=-1)  # [B, m] most likely first
                idx = top[:, 0]  # [B] the chain goes on from the most likely token
                prob_cols.append(top_q)
                token_cols.append(vocab_map[top] if vocab_map is not None else top)  # [B, m]
            else:
                idx = logits.argmax(-1)  # [B]
                if any_sampled:
                    cdf = q.cumsum(-1)  # [B, Vd]
                    u = (uniforms[:, j] * cdf[:, -1])[:, None]  # [B, 1]
                    drawn = torch.searchsorted(cdf, u, right=True)[:, 0].clamp(
                        max=q.shape[-1] - 1
                    )  # [B]
                    idx = torch.where(sampled, drawn, idx)
                    qs.append(q)
                prob_cols.append(q.gather(1, idx[:, None])[:, 0])
                token_cols.append(vocab_map[idx] if vocab_map is not None else idx)
            if j + 1 < k:
                ids = vocab_map[idx] if vocab_map is not None else idx  # [B] target ids
                pos = torch.from_numpy((positions + j)[:, None])  # [B, 1]
                hidden = self.net.step(
                    ids[:, None], hidden, pos, cache, layout.mask(layout.block + j, 1)
                )  # [B, 1, H]
                cache.advance(1)
        if m > 1:
            tokens, confidence, parents = best_first_tree(
                torch.stack(prob_cols, dim=1).tolist(), torch.stack(token_cols, dim=1).tolist()
            )  # [B][k * m] each
            return (torch.tensor(tokens), torch.tensor(confidence), None, torch.tensor(parents))
        tokens = torch.stack(token_cols, dim=1)  # [B, k]
        probs = torch.stack(prob_cols, dim=1)  # [B, k]
        dists = None
        if any_sampled:
            qd = torch.stack(qs, dim=1)  # [B, k, Vd]
            if vocab_map is not None:
                dists = qd.new_zeros(b, k, self.net.target_vocab_size).index_copy_(
                    -1, vocab_map, qd
                )  # [B, k, V]
            else:
                dists = qd
        return tokens, probs, dists, None


def _uniforms(views: list[DraftRequestView], k: int) -> torch.Tensor:
    """[B, k] uniforms in [0, 1): from each row's own generator when it has one."""
    u = torch.rand(len(views), k)
    for i, v in enumerate(views):
        if v.generator is not None and v.temperature > 0:
            u[i] = torch.rand(k, generator=v.generator)
    return u
