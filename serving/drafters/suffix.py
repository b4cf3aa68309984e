"""The model-free suffix drafter (SuffixDecoding / prompt lookup): the day-0 baseline.

Two sources of speculation, each a suffix automaton (serving/drafters/suffix_index.py):

- the request's own context (prompt + output so far): repeats of the prompt, loops in the output;
- a per-tenant index of recent finished outputs, fed by ``remove_request`` on this replica and by
  ``observe`` for outputs other replicas served (a consumer of the trace topic calls it).

Per step and request, the longest suffix of the context (at most ``max_match_len`` tokens) found in
each source is extended greedily with its most frequent continuation (backing off to shorter
suffixes where nothing follows). Every drafted token gets a confidence, its estimated acceptance
given the previous ones were accepted, from the continuation counts and the match length
(``CountPrior``); the draft stops once the probability that all of it is accepted falls below
``min_confidence``, and the source whose draft has the most expected accepted tokens wins.
Drafts are point masses: ``probs`` is 1, and rejection sampling stays lossless.

Cost per step is independent of how much is indexed: per-request cursors advance by the committed
tokens only (re-derived from the last ``max_match_len`` tokens when the index changed), and a draft
is k transitions with cached top children. Measured with benchmarks/suffix_sim.py.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch
from pydantic import BaseModel, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from feedback.trace import DrafterKind, TraceRecord
from serving.drafters.base import DraftProposal, DraftRequestView
from serving.drafters.suffix_index import Cursor, Step, SuffixAutomaton, SuffixIndex, walk

_SERVED_MEMORY = 10_000  # own request ids remembered, so their traces are not indexed twice


class CountPrior(BaseModel):
    """Turns continuation counts into an acceptance estimate: ``(count + s * prior(m)) / (total + s)``
    where ``m`` is the length of the matched suffix plus the tokens already drafted after it and
    ``prior(m) = 1 / (1 + (half_match_len / m) ** slope)``. Defaults were fitted (log-loss) to
    greedy SmolLM2-135M outputs on the warm-up halves of MT-Bench and HumanEval
    (benchmarks/suffix_sim.py); fitted on one domain, they stay calibrated on the other."""

    strength: float = Field(description="Pseudo-occurrences the prior is worth.", gt=0.0)
    half_match_len: float = Field(description="Match length accepted half the time a priori.", gt=0.0)
    slope: float = Field(description="How fast the prior rises with match length.", ge=0.0)

    def confidence(self, count: int, total: int, matched: int) -> float:
        prior = 1.0 / (1.0 + (self.half_match_len / matched) ** self.slope)
        return (count + self.strength * prior) / (total + self.strength)


class SuffixConfig(BaseSettings):
    """Suffix drafter settings (environment: ``SPECLOOP_SUFFIX_<FIELD>``)."""

    model_config = SettingsConfigDict(env_prefix="SPECLOOP_SUFFIX_", extra="forbid")

    max_match_len: int = Field(
        32, ge=1, description="Longest context suffix matched; longer repeats are matched on their "
        "last max_match_len tokens."
    )
    min_match_len: int = Field(
        1, ge=1, description="Shortest matched suffix allowed to propose anything."
    )
    min_confidence: float = Field(
        0.1, ge=0.0, le=1.0, description="Stop drafting once the estimated probability that every "
        "drafted token so far is accepted falls below this. 0 always drafts up to k when a "
        "continuation exists."
    )
    context_prior: CountPrior = Field(
        CountPrior(strength=3.1, half_match_len=3.2, slope=1.5),
        description="Confidence of continuations found in the request's own context.",
    )
    index_prior: CountPrior = Field(
        CountPrior(strength=5.4, half_match_len=6.3, slope=1.65),
        description="Confidence of continuations found in the tenant index (other requests' "
        "outputs repeat less reliably than the request itself).",
    )
    match_candidates: int = Field(
        1, ge=1, description="Match lengths scored per source: the longest, then the next shorter "
        "suffixes (more occurrences, less context). Measured: more than 1 costs time, gains nothing."
    )
    use_prompt_lookup: bool = Field(True, description="Match against the request's own context.")
    use_global_index: bool = Field(
        True, description="Match against the tenant's index of recent finished outputs."
    )
    max_index_tokens: int = Field(
        100_000, ge=16, description="Token budget of each tenant's index; the oldest sequences are "
        "evicted beyond it (a generation at a time). Measured ~390 bytes per indexed token."
    )
    index_generations: int = Field(
        4, ge=1, le=16, description="Generations the index budget is split into: more means finer "
        "eviction and slower lookups."
    )
    index_prompt_tail: int = Field(
        0, ge=0, description="Last prompt tokens indexed in front of each finished output, so the "
        "start of an answer is predicted from the end of its prompt (e.g. the chat template)."
    )
    index_prompts: bool = Field(
        False, description="Index whole prompts with their outputs (shared system prompts, "
        "multi-turn histories); overrides index_prompt_tail."
    )
    max_tenants: int = Field(
        16, ge=1, description="Tenant indexes kept; the least recently used is dropped beyond it."
    )


@dataclass
class Draft:
    """One row's proposal and where it came from."""

    tokens: list[int] = field(default_factory=list)
    confidence: list[float] = field(default_factory=list)
    source: str = ""
    """"context" (prompt lookup) or "index" (tenant index); "" when nothing is proposed."""
    matched: int = 0
    steps: list[Step] = field(default_factory=list)

    @property
    def expected_accepted(self) -> float:
        total, p = 0.0, 1.0
        for c in self.confidence:
            p *= c
            total += p
        return total


@dataclass
class _Request:
    tenant: str
    prompt_len: int
    tokens: list[int]
    own: SuffixAutomaton | None
    cursors: dict[int, Cursor] = field(default_factory=dict)


class SuffixDrafter:
    """Model-free drafter: prompt lookup plus a per-tenant suffix index that learns online."""

    kind = "suffix"
    version = "day0"
    feature_layers: tuple[int, ...] = ()

    def __init__(self, config: SuffixConfig | None = None):
        self.config = config or SuffixConfig()
        self._requests: dict[str, _Request] = {}
        self._indexes: OrderedDict[str, SuffixIndex] = OrderedDict()
        self._lock = threading.Lock()  # observe() may run on a trace-consumer thread
        self._served: OrderedDict[str, None] = OrderedDict()  # ids indexed by remove_request
        self.last_drafts: list[Draft] = []
        """The rows of the latest proposal with their provenance (metrics, benchmarks)."""

    # -- the tenant indexes ----------------------------------------------------------------

    def index(self, tenant: str) -> SuffixIndex:
        idx = self._indexes.get(tenant)
        if idx is None:
            idx = self._indexes[tenant] = SuffixIndex(
                self.config.max_index_tokens, self.config.index_generations
            )
            while len(self._indexes) > self.config.max_tenants:
                self._indexes.popitem(last=False)
        else:
            self._indexes.move_to_end(tenant)
        return idx

    def observe(self, tenant: str, token_ids, prompt_ids=None) -> None:
        """Feed a finished output (e.g. one another replica served, read off the trace topic) into
        ``tenant``'s index. ``prompt_ids``, when given, is indexed as configured for prompts."""
        seq = self._sequence(list(prompt_ids or []), [int(t) for t in token_ids])
        if seq:
            with self._lock:
                self.index(tenant).add(seq)

    def observe_trace(self, record: TraceRecord) -> None:
        """Feed a finished request read off the trace topic. Requests this drafter served itself
        were indexed by remove_request already and are skipped."""
        if record.request_id in self._served:
            return
        self.observe(record.tenant, record.output_ids.tolist(), prompt_ids=record.prompt_ids.tolist())

    def _sequence(self, prompt: list[int], output: list[int]) -> list[int]:
        if not output:
            return []
        if self.config.index_prompts:
            return prompt + output
        tail = self.config.index_prompt_tail
        return (prompt[-tail:] if tail else []) + output

    # -- the Drafter protocol --------------------------------------------------------------

    def add_request(self, view: DraftRequestView, features: torch.Tensor | None = None) -> None:
        own = None
        if self.config.use_prompt_lookup:
            own = SuffixAutomaton()
            for t in view.token_ids:
                own.append(int(t))
        self._requests[view.request_id] = _Request(
            view.tenant, view.prompt_len, [int(t) for t in view.token_ids], own
        )

    def on_verified(
        self, request_id: str, accepted_ids: list[int], features: torch.Tensor | None = None
    ) -> None:
        req = self._requests.get(request_id)
        if req is not None:
            with self._lock:
                self._extend(req, [int(t) for t in accepted_ids])

    def remove_request(self, request_id: str, output_ids: list[int] | None) -> None:
        req = self._requests.pop(request_id, None)
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
        source = np.full(b, DrafterKind.NONE, dtype=np.uint8)
        drafts: list[Draft] = []
        if k > 0:
            with self._lock:
                drafts = [self.draft(view, k) for view in views]
            for i, d in enumerate(drafts):
                n = len(d.tokens)
                if n:
                    tokens[i, :n] = d.tokens
                    confidence[i, :n] = d.confidence
                    lengths[i] = n
                    source[i] = DrafterKind.SUFFIX
        self.last_drafts = drafts
        return DraftProposal(
            tokens=torch.from_numpy(tokens),
            lengths=torch.from_numpy(lengths),
            probs=torch.ones(b, k, dtype=torch.float32),
            source=source,
            confidence=torch.from_numpy(confidence),
            draft_ms=(time.perf_counter() - t0) * 1e3,
        )

    # -- drafting one request --------------------------------------------------------------

    def draft(self, view: DraftRequestView, k: int) -> Draft:
        """The best proposal of at most ``k`` tokens for one request (callers hold the lock when
        observe() may run concurrently)."""
        req = self._sync(view)
        best = Draft()
        if k <= 0:
            return best
        cfg = self.config
        ctx = req.tokens
        if req.own is not None and len(ctx) > 1:
            own = req.own
            state = own.link[own.last]
            for matched, s in self._candidate_lengths(own, state, own.length[state]):
                steps = walk([(own, s)], k, matched, ctx, cfg.min_match_len)
                d = self._score(steps, "context", matched)
                if d.expected_accepted > best.expected_accepted:
                    best = d
        if cfg.use_global_index and req.tenant in self._indexes:
            idx = self.index(req.tenant)
            idx.sync(req.cursors, ctx, cfg.max_match_len)
            live = [(sam, req.cursors[gid]) for gid, sam in idx.gens if req.cursors[gid].matched]
            if live:
                sam0, cur0 = max(live, key=lambda sc: sc[1].matched)
                for matched, _ in self._candidate_lengths(sam0, cur0.state, cur0.matched):
                    nodes = [(sam, sam.shorten(c.state, matched)) for sam, c in live if c.matched >= matched]
                    d = self._score(walk(nodes, k, matched, None, cfg.min_match_len), "index", matched)
                    if d.expected_accepted > best.expected_accepted:
                        best = d
        return best

    def _candidate_lengths(self, sam: SuffixAutomaton, state: int, matched: int):
        """(length, state) for the longest allowed match and the next shorter distinct suffixes."""
        cfg = self.config
        n = min(matched, cfg.max_match_len)
        out = []
        while n >= cfg.min_match_len and state > 0 and len(out) < cfg.match_candidates:
            state = sam.shorten(state, n)
            out.append((n, state))
            state = sam.link[state]
            n = sam.length[state]
        return out

    def _score(self, steps: list[Step], source: str, matched: int) -> Draft:
        """Turn counts into confidences and cut the draft where it stops paying."""
        prior = self.config.context_prior if source == "context" else self.config.index_prior
        floor = self.config.min_confidence
        tokens, confs = [], []
        p = 1.0
        for st in steps:
            c = min(1.0, prior.confidence(st.count, st.total, st.matched))
            p *= c
            if p < floor or c <= 0.0:
                break
            tokens.append(st.token)
            confs.append(c)
        return Draft(tokens, confs, source if tokens else "", matched, steps[: len(tokens)])

    # -- per-request state -----------------------------------------------------------------

    def _sync(self, view: DraftRequestView) -> _Request:
        """The request's state, made to agree with ``view`` (robust to missed on_verified calls)."""
        req = self._requests.get(view.request_id)
        ctx = view.token_ids
        if req is not None and len(req.tokens) <= len(ctx):
            n = len(req.tokens)
            if n == len(ctx) and (n == 0 or req.tokens[-1] == ctx[-1]):
                return req
            if n and req.tokens[-1] == ctx[n - 1]:
                self._extend(req, [int(t) for t in ctx[n:]])
                return req
        self.add_request(view)
        return self._requests[view.request_id]

    def _extend(self, req: _Request, new: list[int]) -> None:
        req.tokens.extend(new)
        if req.own is not None:
            for t in new:
                req.own.append(t)
        idx = self._indexes.get(req.tenant)
        if idx is not None:
            idx.advance(req.cursors, new)
