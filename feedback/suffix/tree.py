"""Best-first token trees over suffix automata (SuffixDecoding / ArcticInference style).

``walk`` (suffix_index.py) follows the single most frequent continuation of a matched suffix; a
tree keeps the other frequent continuations too, so that when the target does not take the most
frequent branch the step can still accept tokens. Nodes are expanded most probable first: a node's
probability is the product of its path's confidences (the caller's ``confidence(count, total,
matched)``, the same calibrated estimate a chain draft uses), so the first n nodes are the n most
probable ones and form a subtree, which is what lets the serving policy cut a tree to any size.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

from feedback.suffix.index import SuffixAutomaton, _total

Nodes = list[tuple[SuffixAutomaton, int]]


def _children(
    nodes: Nodes, matched: int, context: list[int] | None, path: list[int], min_match: int
) -> tuple[list[tuple[int, int]], int, int, Nodes]:
    """(token, count) continuations of the suffix held by ``nodes`` (backing off to shorter
    suffixes while nothing follows), their total, the matched length and nodes used."""
    total = _total(nodes, matched, context, path)
    while total <= 0:
        matched = max(sam.length[sam.link[s]] for sam, s in nodes)
        if matched < min_match:
            return [], 0, matched, nodes
        nodes = [(sam, sam.shorten(s, matched)) for sam, s in nodes]
        total = _total(nodes, matched, context, path)
    counts: dict[int, int] = {}
    for sam, s in nodes:
        cnt = sam.count
        for t, c in sam.top_children(s):
            counts[t] = counts.get(t, 0) + cnt[c]
    if len(nodes) > 1:  # a token in one automaton's top list: count it in all of them
        counts = {
            t: sum(sam.count[c] for sam, s in nodes if (c := sam.next[s].get(t)) is not None)
            for t in counts
        }
    ranked = sorted(counts.items(), key=lambda tc: -tc[1])
    return ranked, total, matched, nodes


def grow_tree(
    roots: list[tuple[Nodes, int, list[int] | None, Callable[[int, int, int], float]]],
    k: int,
    min_match: int,
    floor: float,
    branches: int,
) -> tuple[list[int], list[int], list[float]]:
    """Up to ``k`` nodes: (tokens, parents (-1 = the context), per-node confidence).

    ``roots``: one entry per matched source, (automaton nodes holding the match, matched length,
    the context when the automata index the request's own context (else None), the source's
    ``confidence(count, total, matched)``). The first children of the context come from every
    source (a token proposed by two sources is kept once, from the more probable one); below them
    each subtree follows its own source."""
    tokens: list[int] = []
    parents: list[int] = []
    confs: list[float] = []
    order = itertools.count()
    heap: list = []
    root_tokens: set[int] = set()

    def expand(parent, nodes, matched, path, p, context, confidence) -> None:
        ranked, total, m, used = _children(nodes, matched, context, path, min_match)
        for token, count in ranked[:branches]:
            c = min(1.0, confidence(count, total, m))
            if c > 0.0 and p * c >= floor:
                entry = (-p * c, next(order), parent, token, c, used, m, path, context, confidence)
                heapq.heappush(heap, entry)

    for nodes, matched, context, confidence in roots:
        expand(-1, nodes, matched, [], 1.0, context, confidence)
    while heap and len(tokens) < k:
        neg_p, _, parent, token, c, used, m, path, context, confidence = heapq.heappop(heap)
        if parent == -1:
            if token in root_tokens:
                continue
            root_tokens.add(token)
        tokens.append(token)
        parents.append(parent)
        confs.append(c)
        child = [(sam, n) for sam, s in used if (n := sam.next[s].get(token)) is not None]
        if child and len(tokens) < k:
            expand(len(tokens) - 1, child, m + 1, path + [token], -neg_p, context, confidence)
    return tokens, parents, confs
