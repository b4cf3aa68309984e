"""The model-free suffix drafter (SuffixDecoding / prompt lookup): the day-0 baseline.

Two sources of speculation, each a suffix automaton (feedback/suffix/index.py):

- the request's own context (prompt + output so far): repeats of the prompt, loops in the output;
- a per-tenant index of recent finished outputs, fed by ``remove_request`` on this replica and by
  ``observe`` for outputs other replicas served (a consumer of the trace topic calls it).

How a draft and its per-token confidences are chosen lives in feedback/suffix/draft.py
(``SuffixProposer``), torch-free, so that the trainer's gate simulates exactly these proposals;
this module is the Drafter-protocol adapter around it: per-request state kept in step with the
engine's views, a lock against trace-consumer threads, and the batched tensors. Drafts are point
masses: ``probs`` is 1, and rejection sampling stays lossless. Measured with
benchmarks/suffix_sim.py.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

import numpy as np
import torch

from feedback.bus.trace import DrafterKind, TraceRecord
from feedback.registry.artifact_keys import DAY0_VERSION
from feedback.suffix.draft import CountPrior, Draft, SuffixConfig, SuffixProposer, SuffixRequest
from feedback.suffix.index import SuffixIndex
from serving.drafters.base import DraftProposal, DraftRequestView

__all__ = ["CountPrior", "Draft", "SuffixConfig", "SuffixDrafter"]

_SERVED_MEMORY = 10_000  # own request ids remembered, so their traces are not indexed twice


class SuffixDrafter:
    """Model-free drafter: prompt lookup plus a per-tenant suffix index that learns online."""

    kind = "suffix"
    version = DAY0_VERSION
    feature_layers: tuple[int, ...] = ()

    def __init__(self, config: SuffixConfig | None = None):
        self.proposer = SuffixProposer(config)
        """Tenant indexes and the drafting rule (shared with the trainer's gate)."""
        self.config = self.proposer.config
        self._requests: dict[str, SuffixRequest] = {}
        # observe() may run on a trace-consumer thread; re-entrant: propose -> draft -> _sync may
        # (re)start a request, which takes it too
        self._lock = threading.RLock()
        self._served: OrderedDict[str, None] = OrderedDict()  # ids indexed by remove_request
        self.trees = self.config.tree_branches > 1
        """Propose token trees (point-mass; the engine verifies them in one forward)."""
        self.last_drafts: list[Draft] = []
        """The rows of the latest proposal with their provenance (metrics, benchmarks)."""
        self._unindexed: set[str] = set()  # running when their tenant's data was deleted
        self._steps_behind: dict[str, int] = {}  # request id -> verify steps since its last draft

    # -- the tenant indexes ----------------------------------------------------------------

    def index(self, tenant: str) -> SuffixIndex:
        return self.proposer.index(tenant)

    def observe(self, tenant: str, token_ids, prompt_ids=None) -> None:
        """Feed a finished output (e.g. one another replica served, read off the trace topic) into
        ``tenant``'s index. ``prompt_ids``, when given, is indexed as configured for prompts."""
        with self._lock:
            self.proposer.observe(tenant, token_ids, prompt_ids)

    def indexed_tenants(self) -> list[str]:
        """Tenants with an index here (at most ``max_tenants``: the least recently used go)."""
        with self._lock:
            return list(self.proposer.indexes)

    def forget_tenant(self, tenant: str) -> bool:
        """A data deletion request: drop ``tenant``'s index, and do not index the outputs of its
        requests still running (they keep prompt lookup). True if there was an index."""
        with self._lock:
            gone = self.proposer.indexes.pop(tenant, None) is not None
            for rid, req in self._requests.items():
                if req.tenant == tenant:
                    req.cursors.clear()  # they pointed into the dropped index
                    self._unindexed.add(rid)
        return gone

    def observe_trace(self, record: TraceRecord) -> None:
        """Feed a finished request read off the trace topic. Requests this drafter served itself
        were indexed by remove_request already and are skipped."""
        if record.request_id in self._served:
            return
        self.observe(record.tenant, record.output_ids.tolist(), prompt_ids=record.prompt_ids.tolist())

    # -- the Drafter protocol --------------------------------------------------------------

    def add_request(self, view: DraftRequestView, features: torch.Tensor | None = None) -> None:
        with self._lock:  # a seeded proposer creates the tenant's index here
            self._requests[view.request_id] = self.proposer.start(
                view.tenant, view.token_ids, view.prompt_len
            )

    def on_verified(
        self, request_id: str, accepted_ids: list[int], features: torch.Tensor | None = None
    ) -> None:
        """Counted, not committed: a request's state catches up from its view when it next
        drafts (``_sync``), the same work in one go. Committed here, every row paid ~16 us a step
        at batch 8 on a 2-core AVX2 EPYC (~0.6 % of a step) while the goodput policy kept this
        drafter off there. What a row commits beyond its last step's tokens is the proposal's
        ``catch_up_ms``."""
        self._steps_behind[request_id] = self._steps_behind.get(request_id, 0) + 1

    def remove_request(self, request_id: str, output_ids: list[int] | None) -> None:
        req = self._requests.pop(request_id, None)
        self._steps_behind.pop(request_id, None)
        if request_id in self._unindexed:
            self._unindexed.discard(request_id)
            return
        if req is None or output_ids is None:
            return
        self._served[request_id] = None
        if len(self._served) > _SERVED_MEMORY:
            self._served.popitem(last=False)
        self.observe(req.tenant, output_ids, prompt_ids=req.tokens[: req.prompt_len])

    def propose(self, views: list[DraftRequestView], k: int) -> DraftProposal:
        t0 = time.perf_counter()
        b = len(views)
        tokens = np.zeros((b, k), dtype=np.int64)  # [B, k]
        lengths = np.zeros(b, dtype=np.int64)  # [B]
        confidence = np.zeros((b, k), dtype=np.float32)  # [B, k]
        parents = np.tile(np.arange(-1, k - 1, dtype=np.int64), (b, 1))  # [B, k] chains
        source = np.full(b, DrafterKind.NONE, dtype=np.uint8)
        drafts: list[Draft] = []
        catch_up_ms = 0.0
        if k > 0:
            with self._lock:
                reqs = []
                for view in views:  # the tokens committed since each row's last draft
                    t = time.perf_counter()
                    reqs.append(self._sync(view))
                    if self._steps_behind.pop(view.request_id, 0) > 1:  # more than the last step's
                        catch_up_ms += (time.perf_counter() - t) * 1e3
                drafts = [self._draft(req, k) for req in reqs]
            for i, d in enumerate(drafts):
                n = len(d.tokens)
                if n:
                    tokens[i, :n] = d.tokens
                    confidence[i, :n] = d.confidence
                    lengths[i] = n
                    source[i] = DrafterKind.SUFFIX
                    if d.parents is not None:
                        parents[i, :n] = d.parents
        self.last_drafts = drafts
        return DraftProposal(
            tokens=torch.from_numpy(tokens),
            lengths=torch.from_numpy(lengths),
            probs=torch.from_numpy(np.ones((b, k), dtype=np.float32)),  # torch.ones: ~3x on a step thread
            source=source,
            confidence=torch.from_numpy(confidence),
            draft_ms=(time.perf_counter() - t0) * 1e3,
            parents=torch.from_numpy(parents) if self.trees else None,
            catch_up_ms=catch_up_ms,
        )

    def _draft(self, req: SuffixRequest, k: int) -> Draft:
        """The best proposal of at most ``k`` tokens for one request synced to its view (callers
        hold the lock: observe() may run concurrently). A token tree when ``trees`` is set."""
        if self.trees:
            return self.proposer.draft_tree(req, k, self.config.tree_branches)
        return self.proposer.draft(req, k)

    # -- per-request state -----------------------------------------------------------------

    def _sync(self, view: DraftRequestView) -> SuffixRequest:
        """The request's state, made to agree with ``view`` (robust to missed on_verified calls)."""
        req = self._requests.get(view.request_id)
        ctx = view.token_ids
        if req is not None and len(req.tokens) <= len(ctx):
            n = len(req.tokens)
            if n == len(ctx) and (n == 0 or req.tokens[-1] == ctx[-1]):
                return req
            if n and req.tokens[-1] == ctx[n - 1]:
                self.proposer.extend(req, [int(t) for t in ctx[n:]])
                return req
        self.add_request(view)
        return self._requests[view.request_id]


def suffix_part(drafter):
    """The drafter's suffix index holder (SuffixDrafter or a hybrid's suffix half), or None: what a
    trace follower feeds, and whether a replica needs one at all."""
    if drafter is None:
        return None
    if callable(getattr(drafter, "observe_trace", None)):
        return drafter
    inner = getattr(drafter, "suffix", None)
    return inner if callable(getattr(inner, "observe_trace", None)) else None
