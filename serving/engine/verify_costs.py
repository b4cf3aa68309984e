"""VerifyCosts: what a verify step of n drafted nodes (in all, over the rows) costs at each batch
size, as measured. The methods say "width" for that n.

The width choice (GoodputPolicy.choose_widths) compares a plain step with wider ones, so what
matters is their ratio, and on a shared VM two things bias it:

- spikes: single steps 10-20 ms slow (a neighbour, a page-fault storm). An EMA carries one for
  tens of steps; at batch 8 one left the plain step's cost at 33.4 ms when its steps took 30.5
  on average, so an 8-row draft that needed 4.8 accepted tokens to pay looked like it needed
  3.5, and was taken, and lost;
- slow periods lasting seconds, in which every step is ~10 % slower: a width measured in one and
  read in a fast period is overpriced, and the other way round.

So the plain step (width 0) at each batch size is the median of its recent steps, and a width
W > 0 is remembered as the median of its recent ratios to the plain median at the time it ran:
cost(W) = plain median x ratio median. Plain steps are most steps, so their median follows the
machine's current speed, and the ratio carries it over to the widths measured more rarely.
"""

from __future__ import annotations

import statistics
from collections import deque

_PLAIN_WINDOW = 15
_WIDE_WINDOW = 7


class VerifyCosts:
    def __init__(self, plain_window: int = _PLAIN_WINDOW, wide_window: int = _WIDE_WINDOW):
        self._plain: dict[int, deque[float]] = {}  # batch -> recent plain-step ms
        self._wide: dict[int, dict[int, deque[tuple[float, float | None]]]] = {}
        """batch -> width -> recent (ms, plain median at the time or None)"""
        self._plain_window, self._wide_window = plain_window, wide_window
        self._measured_memo: dict[int, dict[int, float]] = {}
        """``measured`` per batch since the last observation: the width choice asks for every
        width each step."""
        self._growth_memo: dict[int, float] = {}
        """``_growth_per_node`` at each batch's widest measured total, as long as ``measured``'s memo:
        every total past it asks for the same line."""

    def observe(self, batch: int, width: int, ms: float) -> None:
        self._measured_memo.clear()
        self._growth_memo.clear()
        if width == 0:
            self._plain.setdefault(batch, deque(maxlen=self._plain_window)).append(ms)
            return
        widths = self._wide.setdefault(batch, {})
        widths.setdefault(width, deque(maxlen=self._wide_window)).append((ms, self.plain_ms(batch)))

    def plain_ms(self, batch: int) -> float | None:
        steps = self._plain.get(batch)
        return statistics.median(steps) if steps else None

    def get(self, batch: int, width: int) -> float | None:
        """Measured cost (ms) of ``width`` drafts per row at ``batch`` rows; None if never run."""
        plain = self.plain_ms(batch)
        if width == 0:
            return plain
        samples = self._wide.get(batch, {}).get(width)
        if not samples:
            return None
        ratios = [ms / ref for ms, ref in samples if ref]
        if plain is not None and ratios:
            return plain * statistics.median(ratios)
        return statistics.median(ms for ms, _ in samples)

    def measured(self, batch: int) -> dict[int, float]:
        """{width: ms} of every width run at ``batch`` rows (do not modify: shared until the next
        observation)."""
        if batch not in self._measured_memo:
            widths = ([0] if batch in self._plain else []) + sorted(self._wide.get(batch, {}))
            self._measured_memo[batch] = {
                w: ms for w in widths if (ms := self.get(batch, w)) is not None
            }
        return self._measured_memo[batch]

    def price(self, batch: int, nodes: int, step_ms: float, slope: float) -> float:
        """Verify milliseconds of ``nodes`` drafted tokens in all at ``batch`` rows: measured;
        else at least the most nodes measured below it, and at least ``slope`` (the prior's
        per-token growth) over the tokens they add (a verify of n drafts for B rows is a forward
        of B + n real tokens: pricing 8 rows x 4 nodes like 4 nodes let the first 8-row drafts
        look like 1.09 plain steps; they cost 2.7), and at least on the line between the measured
        totals around it; past the most nodes measured, at least on the line through it at the
        growth per node measured below it (``_growth_per_node``). Where nothing is measured at this
        batch size, ``batch`` one-token steps of ``step_ms`` at that growth."""
        seen = self.measured(batch)
        if nodes in seen:
            return seen[nodes]
        grown = 1.0 + slope * nodes
        if not seen:
            return step_ms * batch * grown
        plain = seen.get(0, min(seen.values()))
        below = [n for n in seen if n < nodes]
        above = [n for n in seen if n > nodes]
        bounds = [plain * grown] + [seen[n] for n in below]
        if below and above:  # on the line between the measured totals around it
            lo, hi = max(below), min(above)
            bounds.append(seen[lo] + (seen[hi] - seen[lo]) * (nodes - lo) / (hi - lo))
        elif below:  # past the most nodes measured
            top = max(below)
            if batch not in self._growth_memo:
                self._growth_memo[batch] = _growth_per_node(seen, top)
            bounds.append(seen[top] + (nodes - top) * self._growth_memo[batch])
        return max(bounds)


def _growth_per_node(seen: dict[int, float], top: int) -> float:
    """Milliseconds per drafted node measured up to ``top`` nodes: the steepest line from a total
    at most half of ``top`` (plain steps included) to ``top``, at least 0. A CPU verify is a
    forward of B + n tokens whose cost rises with n, faster past ~8 tokens where the products
    are compute-bound: at batch 8 on a 2-core AVX2 EPYC, 14 nodes cost 49 ms and the prior's flat
    slope priced 48 nodes at 47 ms; they cost 126 (~2.2 ms a node, as from 0 to 14). Spans of at
    least half keep two neighbouring totals' noise from setting the line."""
    lines = [(seen[top] - seen[n]) / (top - n) for n in seen if n < top and top - n >= top / 2]
    return max([0.0, *lines])
