"""The watch after a swap (serving/swap.py's Swapper): is the version swapped in worse than its
predecessor?

From the swap on, every verify step of the new version reaches ``SwapWatch.on_step`` (the
LiveAcceptance listener, on the engine's thread); ``RollbackJudge`` compares the accept lengths of
its learned-draft rows with those of the predecessor's last such steps (serving/live_acceptance.py)
and decides once. A rollback verdict rolls back on a thread of its own (the Swapper's worker may
be busy downloading the next version, and a drafter that lowers acceptance should not serve
until it is done); a kept one is handed to the Swapper's worker. Either verdict is logged on the
watched version's MLflow run (``verdict_metrics``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from serving.live_acceptance import RollbackJudge, Verdict, VersionStats
from serving.swap_errors import NothingToRollBack

log = logging.getLogger(__name__)


@dataclass
class _Watch:
    version: str
    baseline: list[float]
    """The previous version's last learned-draft steps' accept lengths, at the swap."""
    live: list[float] = field(default_factory=list)
    """Its learned-draft steps' accept lengths since the swap."""
    steps: int = 0
    """Its steps since the swap, drafting or not."""
    done: bool = False


def verdict_metrics(v: Verdict) -> dict[str, float]:
    """The watch's verdict as metrics of the watched version's run: ``watch_live`` (its mean accept
    length at learned-draft rows since the swap), ``watch_baseline`` (the predecessor's over its
    last such steps), ``watch_floor`` (floor_ratio x baseline) and ``watch_steps`` (the
    learned-draft steps judged). Rolled back where watch_live < watch_floor beyond the noise."""
    return {"watch_live": v.live, "watch_floor": v.floor, "watch_baseline": v.baseline,
            "watch_steps": float(v.steps)}


class SwapWatch:
    """``rollback(version, verdict)``: roll ``version`` back (may raise NothingToRollBack when it
    is no longer live); ``kept(version, verdict)`` and ``decided(version, verdict)`` (every
    verdict, first) must not block: they run on the engine's thread."""

    def __init__(self, judge: RollbackJudge, *, rollback: Callable[[str, Verdict], None],
                 kept: Callable[[str, Verdict], None], decided: Callable[[str, Verdict], None]):
        self._judge = judge
        self._rollback, self._kept, self._decided = rollback, kept, decided
        self._w: _Watch | None = None

    def begin(self, version: str, baseline: list[float]) -> None:
        """Watch ``version``, just swapped in after a predecessor whose steps were ``baseline``."""
        self._w = _Watch(version, baseline)

    def end(self) -> None:
        self._w = None

    @property
    def watching(self) -> str | None:
        w = self._w
        return w.version if w is not None and not w.done else None

    def on_step(self, version: str, stats: VersionStats) -> None:
        """Engine thread: decide at the end of the watch; the rollback itself runs apart."""
        w = self._w
        if w is None or w.done or version != w.version:
            return
        w.steps += 1
        if stats.last_drafted is not None:
            w.live.append(stats.last_drafted)
        verdict = self._judge.verdict(w.baseline, w.live, w.steps)
        if verdict is None:
            return
        w.done = True
        self._decided(w.version, verdict)
        if verdict.rollback:  # not behind a download the worker may be waiting on
            threading.Thread(target=self._roll_back, args=(w.version, verdict),
                             name="drafter-rollback", daemon=True).start()
        else:
            self._kept(w.version, verdict)

    def _roll_back(self, version: str, verdict: Verdict) -> None:
        try:
            self._rollback(version, verdict)
        except NothingToRollBack:
            pass
        except Exception:  # the engine keeps what it has; the next watch may decide
            log.exception("rollback of drafter %s failed", version)
