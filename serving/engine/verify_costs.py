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

    def observe(self, batch: int, width: int, ms: float) -> None:
        self._measured_memo.clear()
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
