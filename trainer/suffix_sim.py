"""A small trainer-side model of the suffix drafter, for the gate's hybrid simulation.

Prompt lookup plus a global n-gram index over training outputs: at a position, the longest suffix
of the context (``max_ngram`` down to ``min_ngram`` tokens) seen before, in the request's own
context first, then in the index, proposes the tokens that followed it. It approximates
serving/drafters/suffix.py (which trainer/ must not import); the gate uses it identically for
candidate and champion, so the approximation does not bias the comparison.
"""

from __future__ import annotations

import numpy as np


class SuffixSim:
    def __init__(self, min_ngram: int = 2, max_ngram: int = 4, max_continuation: int = 16):
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self.max_continuation = max_continuation
        self._index: dict[tuple[int, ...], tuple[int, ...]] = {}

    def add(self, tokens) -> None:
        """Index every n-gram of a finished sequence -> the tokens that followed (latest wins)."""
        toks = [int(t) for t in tokens]
        for n in range(self.min_ngram, self.max_ngram + 1):
            for i in range(len(toks) - n):
                self._index[tuple(toks[i : i + n])] = tuple(toks[i + n : i + n + self.max_continuation])

    def propose(self, context: list[int], k: int) -> list[int]:
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(context) <= n:
                continue
            tail = context[-n:]
            # prompt lookup: latest earlier occurrence in this request's own context
            for i in range(len(context) - n - 1, -1, -1):
                if context[i : i + n] == tail:
                    return context[i + n : i + n + k]
            cont = self._index.get(tuple(tail))
            if cont:
                return list(cont[:k])
        return []


def match_len(proposal: list[int], truth: np.ndarray) -> int:
    """Leading tokens of ``proposal`` equal to ``truth`` (greedy acceptance)."""
    n = 0
    for a, b in zip(proposal, truth):
        if int(a) != int(b):
            break
        n += 1
    return n
