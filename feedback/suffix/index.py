"""Suffix automata with occurrence counts: the data structure behind the suffix drafter.

Pure Python (no torch), in feedback/ because both sides run it: serving's suffix drafter
(serving/drafters/suffix.py, through feedback/suffix/draft.py) and the trainer's promotion gate,
which replays held-out traces through the very drafter serving runs.

A suffix automaton (SAM) over a set of token sequences has one state per class of substrings that
end at the same set of positions; it has at most 2N states and 3N transitions for N tokens, grows
online in amortised O(1) per token, and:

- matches the longest suffix of a growing context incrementally: one transition (or a few suffix
  links) per new context token, whatever N is (``Cursor``);
- knows how often each substring occurs (``count``: its number of end positions), so the next-token
  frequencies after a matched suffix ``s`` are ``count[next[s][t]] / count[s]``, and following the
  most frequent transition repeatedly gives the most frequent multi-token continuation
  (``walk``), which is what the suffix tree of SuffixDecoding provides, in O(N) memory rather
  than O(N * depth).

A SAM cannot forget, so ``SuffixIndex`` (one per tenant) keeps a few generations of automata and
drops the oldest generation when the token budget is exceeded.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass

_TOP = 4  # children kept per state in the top-children cache


class SuffixAutomaton:
    """Online generalised suffix automaton over token sequences, with occurrence counts.

    State 0 is the root (empty string). Per state: ``length`` of its longest string, suffix
    ``link``, ``count`` of end positions (occurrences), ``next`` transitions {token: state}.
    """

    __slots__ = ("_last", "_top", "count", "length", "link", "next", "num_tokens")

    def __init__(self) -> None:
        self.length: list[int] = [0]
        self.link: list[int] = [-1]
        self.count: list[int] = [0]
        self.next: list[dict[int, int]] = [{}]
        self.num_tokens = 0
        """Tokens added so far; also a change stamp (cursors and caches re-derive when it moves)."""
        self._last = 0
        self._top: dict[int, list[tuple[int, int]]] = {}

    @property
    def num_states(self) -> int:
        return len(self.length)

    @property
    def last(self) -> int:
        """The state of the whole current sequence (its suffix link: the longest suffix of it that
        also occurs earlier)."""
        return self._last

    # -- building --------------------------------------------------------------------------

    def add_sequence(self, tokens) -> None:
        """Add one whole sequence (its substrings never join those of other sequences)."""
        self._last = 0
        for t in tokens:
            self.append(int(t))

    def start_sequence(self) -> None:
        self._last = 0

    def append(self, token: int) -> None:
        """Extend the current sequence by one token."""
        length, link, nxt = self.length, self.link, self.next
        self.num_tokens += 1
        p = self._last
        if self._top:
            # Only states holding suffixes of the sequence so far gain transitions or have
            # children whose counts grow: drop their cached rankings.
            v = p
            while v != -1:
                self._top.pop(v, None)
                v = link[v]
        q = nxt[p].get(token)
        if q is not None:  # this extension already exists (another sequence had it)
            last = q if length[q] == length[p] + 1 else self._clone(p, q, token)
        else:
            last = self._new_state(length[p] + 1, 0, {})
            while p != -1 and token not in nxt[p]:
                nxt[p][token] = last
                p = link[p]
            if p != -1:
                q = nxt[p][token]
                link[last] = q if length[p] + 1 == length[q] else self._clone(p, q, token)
        self._last = last
        count = self.count
        v = last
        while v != -1:  # the new end position belongs to every suffix of the new string
            count[v] += 1
            v = link[v]

    def _new_state(self, length: int, link: int, nxt: dict[int, int]) -> int:
        self.length.append(length)
        self.link.append(link)
        self.count.append(0)
        self.next.append(nxt)
        return len(self.length) - 1

    def _clone(self, p: int, q: int, token: int) -> int:
        """Split q: its strings of length <= length[p]+1 move to a clone, which now also ends at
        the position being added (counted by the caller's walk up the suffix links)."""
        length, link, nxt = self.length, self.link, self.next
        clone = self._new_state(length[p] + 1, link[q], dict(nxt[q]))
        self.count[clone] = self.count[q]
        while p != -1 and nxt[p].get(token) == q:
            nxt[p][token] = clone
            p = link[p]
        link[q] = clone
        return clone

    # -- reading ---------------------------------------------------------------------------

    def step(self, state: int, matched: int, token: int) -> tuple[int, int]:
        """Longest-match update: (state, matched) for context c -> the same for c + [token]."""
        length, link, nxt = self.length, self.link, self.next
        while True:
            child = nxt[state].get(token)
            if child is not None:
                return child, matched + 1
            if state == 0:
                return 0, 0
            state = link[state]
            matched = length[state]

    def match(self, tokens) -> tuple[int, int]:
        """(state, length) of the longest suffix of ``tokens`` that occurs in the automaton."""
        state, matched = 0, 0
        for t in tokens:
            state, matched = self.step(state, matched, t)
        return state, matched

    def shorten(self, state: int, n: int) -> int:
        """The state holding the length-``n`` suffix of a string held by ``state``."""
        length, link = self.length, self.link
        while length[link[state]] >= n:
            state = link[state]
        return state

    def top_children(self, state: int) -> list[tuple[int, int]]:
        """Up to 4 (token, child) transitions of ``state``, most frequent first (cached until an
        append touches the state)."""
        top = self._top.get(state)
        if top is None:
            count = self.count
            items = self.next[state].items()
            if len(items) <= _TOP:
                top = sorted(items, key=lambda tc: -count[tc[1]])
            else:
                top = heapq.nlargest(_TOP, items, key=lambda tc: count[tc[1]])
            self._top[state] = top
        return top


@dataclass
class Cursor:
    """Incremental longest-suffix match of one request's context against one automaton."""

    state: int = 0
    matched: int = 0
    stamp: int = -1
    """``num_tokens`` of the automaton when this match was derived; -1 = never."""


@dataclass
class Step:
    """One token of a walked continuation and the counts behind it."""

    token: int
    count: int
    """Occurrences of the matched suffix followed by this token."""
    total: int
    """Occurrences of the matched suffix followed by anything."""
    matched: int
    """Length of the suffix (of context + tokens drafted so far) these counts are about."""


def walk(
    nodes: list[tuple[SuffixAutomaton, int]],
    k: int,
    matched: int,
    context: list[int] | None = None,
    min_match: int = 1,
) -> list[Step]:
    """Greedy most-frequent continuation, up to ``k`` tokens, of a suffix of length ``matched``
    held by ``nodes`` (automata paired with the state holding that suffix; counts are summed).

    Where the suffix has no continuation, the walk backs off to the longest shorter suffix that has
    one (at least ``min_match`` tokens). With ``context`` given, the automata index that very
    context: occurrences ending at its end are not counted, as nothing follows them yet (a loop is
    then followed through its earlier turns).
    """
    steps: list[Step] = []
    path: list[int] = []
    total = _total(nodes, matched, context, path)
    while len(steps) < k:
        while total <= 0:  # nothing follows: back off to a shorter suffix
            matched = max(sam.length[sam.link[s]] for sam, s in nodes)
            if matched < min_match:
                return steps
            nodes = [(sam, sam.shorten(s, matched)) for sam, s in nodes]
            total = _total(nodes, matched, context, path)
        if len(nodes) == 1:
            sam, s = nodes[0]
            token, child = sam.top_children(s)[0]
            count = sam.count[child]
        else:  # rank by each automaton's own top children, then count the winner everywhere
            counts: dict[int, int] = {}
            for sam, s in nodes:
                cnt = sam.count
                for t, c in sam.top_children(s):
                    counts[t] = counts.get(t, 0) + cnt[c]
            token = max(counts, key=counts.__getitem__)
            count = sum(sam.count[c] for sam, s in nodes if (c := sam.next[s].get(token)) is not None)
        steps.append(Step(token, count, total, matched))
        path.append(token)
        matched += 1
        nodes = [(sam, c) for sam, s in nodes if (c := sam.next[s].get(token)) is not None]
        total = _total(nodes, matched, context, path)
    return steps


def _total(nodes, matched: int, context: list[int] | None, path: list[int]) -> int:
    """Occurrences of the suffix held by ``nodes`` that may have a continuation (0 if none has)."""
    if not any(sam.next[s] for sam, s in nodes):
        return 0
    total = sum(sam.count[s] for sam, s in nodes)
    if context is not None and _at_the_end(context, matched, path):
        total -= 1
    return total


def _at_the_end(context: list[int], matched: int, path: list[int]) -> bool:
    """Does ``context`` end with the last ``matched`` tokens of ``context + path``?"""
    if not path:
        return True
    if matched > len(context):
        return False
    w = path[-matched:] if matched <= len(path) else context[len(context) - (matched - len(path)) :] + path
    return context[len(context) - matched :] == w


class SuffixIndex:
    """One tenant's index of recent sequences: a few generations of suffix automata.

    New sequences go into the newest generation; once it holds ``max_tokens / generations`` tokens
    a new one is started, and generations beyond ``generations`` are dropped, oldest first. Memory
    is therefore bounded by about ``max_tokens`` tokens, and at least the most recent
    ``max_tokens * (generations - 1) / generations`` tokens are always indexed. A sequence longer
    than a generation is cut to its first ``max_tokens / generations`` tokens.

    ``seed``: a read-only automaton (the target's own answers before any traffic,
    feedback/suffix/seed.py) that every tenant's index starts with as its oldest generation. It is
    shared between indexes, never appended to, and evicted like any generation once traffic has
    filled the others.
    """

    _ids = itertools.count()

    def __init__(self, max_tokens: int = 200_000, generations: int = 4, seed: SuffixAutomaton | None = None):
        if max_tokens < generations or generations < 1:
            raise ValueError("need max_tokens >= generations >= 1")
        self.max_tokens = max_tokens
        self.generations = generations
        self.gen_tokens = max_tokens // generations
        self.gens: deque[tuple[int, SuffixAutomaton]] = deque()
        self.num_sequences = 0
        self._seed_gid: int | None = None
        if seed is not None and seed.num_tokens:
            self._seed_gid = next(self._ids)
            self.gens.append((self._seed_gid, seed))

    @property
    def num_tokens(self) -> int:
        return sum(sam.num_tokens for _, sam in self.gens)

    @property
    def num_states(self) -> int:
        return sum(sam.num_states for _, sam in self.gens)

    def add(self, tokens) -> None:
        tokens = list(tokens)[: self.gen_tokens]
        if not tokens:
            return
        newest = self.gens[-1] if self.gens else None
        if newest is None or newest[0] == self._seed_gid or newest[1].num_tokens + len(tokens) > self.gen_tokens:
            self.gens.append((next(self._ids), SuffixAutomaton()))
            while len(self.gens) > self.generations:
                self.gens.popleft()
        self.gens[-1][1].add_sequence(tokens)
        self.num_sequences += 1

    def sync(self, cursors: dict[int, Cursor], context: list[int], max_match: int) -> None:
        """Bring one request's cursors (keyed by generation id) up to date with ``context``:
        re-derived from the last ``max_match`` tokens when a generation changed, dropped for
        generations that are gone."""
        live = set()
        for gid, sam in self.gens:
            live.add(gid)
            cur = cursors.get(gid)
            if cur is None:
                cur = cursors[gid] = Cursor()
            if cur.stamp != sam.num_tokens:
                cur.state, cur.matched = sam.match(context[-max_match:])
                cur.stamp = sam.num_tokens
        for gid in [g for g in cursors if g not in live]:
            del cursors[gid]

    def advance(self, cursors: dict[int, Cursor], tokens: list[int]) -> None:
        """Extend fresh cursors by newly committed tokens (stale ones re-derive at the next sync)."""
        for gid, sam in self.gens:
            cur = cursors.get(gid)
            if cur is None or cur.stamp != sam.num_tokens:
                continue
            state, matched = cur.state, cur.matched
            for t in tokens:
                state, matched = sam.step(state, matched, t)
            cur.state, cur.matched = state, matched
