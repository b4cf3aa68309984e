"""The suffix drafter's proposals without torch: settings, confidences, tenant indexes, drafting.

Two sources of speculation, each a suffix automaton (feedback/suffix/index.py):

- the request's own context (prompt + output so far): repeats of the prompt, loops in the output;
- a per-tenant index of recent finished outputs (``SuffixProposer.observe``).

Per step and request, the longest suffix of the context (at most ``max_match_len`` tokens) found in
each source is extended greedily with its most frequent continuation (backing off to shorter
suffixes where nothing follows). Every drafted token gets a confidence, its estimated acceptance
given the previous ones were accepted, from the continuation counts and the match length
(``CountPrior``); the draft stops once the probability that all of it is accepted falls below
``min_confidence``, and the source whose draft has the most expected accepted tokens wins.

Cost per step is independent of how much is indexed: per-request cursors advance by the committed
tokens only (re-derived from the last ``max_match_len`` tokens when the index changed), and a draft
is k transitions with cached top children.

This is the one implementation of those proposals: serving's ``SuffixDrafter``
(serving/drafters/suffix.py) is the Drafter-protocol adapter around ``SuffixProposer`` (request
bookkeeping, locking, tensors), and the trainer's gate (trainer/gate.py) replays held-out traces
through a ``SuffixProposer`` fed with the training traces, so it simulates exactly what serving
drafts. Not thread-safe: callers serialise ``observe`` against drafting.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from feedback.suffix.index import Cursor, Step, SuffixAutomaton, SuffixIndex, walk
from feedback.suffix.seed import seed_automaton
from feedback.suffix.tree import grow_tree


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
    tree_branches: int = Field(
        4, ge=1, le=4, description="Children per node of the token trees serving's suffix drafter "
        "proposes (best-first over the match's continuations); 1 = chains. The trainer's gate "
        "simulates chains."
    )
    max_tenants: int = Field(
        16, ge=1, description="Tenant indexes kept; the least recently used is dropped beyond it."
    )
    seed_file: Path | None = Field(
        None, description="A suffix seed (feedback/suffix/seed.py: the target's own answers before "
        "any traffic) every tenant's index starts with; None: indexes start empty."
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
    parents: list[int] | None = None
    """Token tree (``SuffixProposer.draft_tree``): parent of each token as an index into
    ``tokens`` (-1: follows the context); None for a chain. ``confidence`` is then per node given
    its parent was accepted, and nodes come best-first (any prefix is a subtree)."""
    start: tuple | None = field(default=None, repr=False)
    """Where this proposal's match starts: (automaton nodes, matched length, context)."""
    starts: list = field(default_factory=list, repr=False)
    """(source, start) of every candidate that proposed something, the most expected first."""

    @property
    def expected_accepted(self) -> float:
        total, p = 0.0, 1.0
        for c in self.confidence:
            p *= c
            total += p
        return total


@dataclass
class SuffixRequest:
    """One request's matching state: its tokens so far, an automaton over them (prompt lookup;
    None when that is off) and its cursors into the tenant index (keyed by generation id)."""

    tenant: str
    prompt_len: int
    tokens: list[int]
    own: SuffixAutomaton | None
    cursors: dict[int, Cursor] = field(default_factory=dict)


class SuffixProposer:
    """Per-tenant suffix indexes plus the drafting rule, for requests held as ``SuffixRequest``."""

    def __init__(self, config: SuffixConfig | None = None):
        self.config = config or SuffixConfig()
        self.indexes: OrderedDict[str, SuffixIndex] = OrderedDict()
        self.seed: SuffixAutomaton | None = None
        """Every tenant index's read-only oldest generation (``config.seed_file``)."""
        if self.config.seed_file is not None and self.config.use_global_index:
            self.seed = seed_automaton(self.config.seed_file)

    # -- the tenant indexes ----------------------------------------------------------------

    def index(self, tenant: str) -> SuffixIndex:
        """``tenant``'s index (created if missing; least recently used tenants are dropped)."""
        idx = self.indexes.get(tenant)
        if idx is None:
            idx = self.indexes[tenant] = SuffixIndex(
                self.config.max_index_tokens, self.config.index_generations, seed=self.seed
            )
            while len(self.indexes) > self.config.max_tenants:
                self.indexes.popitem(last=False)
        else:
            self.indexes.move_to_end(tenant)
        return idx

    def sequence(self, prompt: list[int], output: list[int]) -> list[int]:
        """What a finished request contributes to its tenant's index (per the prompt settings)."""
        if not output:
            return []
        if self.config.index_prompts:
            return prompt + output
        tail = self.config.index_prompt_tail
        return (prompt[-tail:] if tail else []) + output

    def observe(self, tenant: str, token_ids, prompt_ids=None) -> None:
        """Index a finished output of ``tenant`` (``prompt_ids`` as configured for prompts)."""
        prompt = [] if prompt_ids is None else [int(t) for t in prompt_ids]
        seq = self.sequence(prompt, [int(t) for t in token_ids])
        if seq:
            self.index(tenant).add(seq)

    # -- requests --------------------------------------------------------------------------

    def start(self, tenant: str, token_ids, prompt_len: int) -> SuffixRequest:
        """A request whose context is ``token_ids`` (of which ``prompt_len`` are prompt)."""
        tokens = [int(t) for t in token_ids]
        own = None
        if self.config.use_prompt_lookup:
            own = SuffixAutomaton()
            for t in tokens:
                own.append(t)
        if self.seed is not None:
            self.index(tenant)  # a seeded index drafts from a tenant's first request on
        return SuffixRequest(tenant, prompt_len, tokens, own)

    def extend(self, req: SuffixRequest, new: list[int]) -> None:
        """Commit ``new`` tokens to the request's context."""
        req.tokens.extend(new)
        if req.own is not None:
            for t in new:
                req.own.append(t)
        idx = self.indexes.get(req.tenant)
        if idx is not None:
            idx.advance(req.cursors, new)

    # -- drafting --------------------------------------------------------------------------

    def draft(self, req: SuffixRequest, k: int) -> Draft:
        """The best proposal of at most ``k`` tokens to follow the request's context."""
        best = Draft()
        if k <= 0:
            return best
        cfg = self.config
        ctx = req.tokens
        starts = []  # every candidate that proposes something: (expected, source, start)
        if req.own is not None and len(ctx) > 1:
            own = req.own
            state = own.link[own.last]
            for matched, s in self._candidate_lengths(own, state, own.length[state]):
                steps = walk([(own, s)], k, matched, ctx, cfg.min_match_len)
                d = self._score(steps, "context", matched)
                d.start = ([(own, s)], matched, ctx)
                if d.tokens:
                    starts.append((d.expected_accepted, "context", d.start))
                if d.expected_accepted > best.expected_accepted:
                    best = d
        if cfg.use_global_index and req.tenant in self.indexes:
            idx = self.index(req.tenant)
            idx.sync(req.cursors, ctx, cfg.max_match_len)
            live = [(sam, req.cursors[gid]) for gid, sam in idx.gens if req.cursors[gid].matched]
            if live:
                sam0, cur0 = max(live, key=lambda sc: sc[1].matched)
                for matched, _ in self._candidate_lengths(sam0, cur0.state, cur0.matched):
                    nodes = [(sam, sam.shorten(c.state, matched)) for sam, c in live if c.matched >= matched]
                    d = self._score(walk(nodes, k, matched, None, cfg.min_match_len), "index", matched)
                    d.start = (nodes, matched, None)
                    if d.tokens:
                        starts.append((d.expected_accepted, "index", d.start))
                    if d.expected_accepted > best.expected_accepted:
                        best = d
        best.starts = [(src, st) for _, src, st in sorted(starts, key=lambda e: -e[0])]
        return best

    def draft_tree(self, req: SuffixRequest, k: int, branches: int = 4) -> Draft:
        """A token tree of at most ``k`` nodes over the continuations of every candidate match
        (prompt lookup and tenant index, each scored with its own prior): the most probable nodes
        first (path probability = product of confidences), up to ``branches`` children per node,
        while the path probability stays above ``min_confidence``."""
        best = self.draft(req, k)
        if not best.tokens or not best.starts or branches <= 1:
            return best
        cfg = self.config
        roots = [
            (*start, (cfg.context_prior if src == "context" else cfg.index_prior).confidence)
            for src, start in best.starts
        ]
        tokens, parents, confs = grow_tree(
            roots, k, cfg.min_match_len, cfg.min_confidence, branches
        )
        if not tokens:
            return best
        return Draft(tokens, confs, best.source, best.matched, [], parents)

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
