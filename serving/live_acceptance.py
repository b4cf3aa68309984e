"""Live acceptance per drafter version, and the test that decides a rollback from it.

Live acceptance = tokens emitted per verify step and row (accepted drafts + 1). ``LiveAcceptance``
(a StepObserver) keeps, per drafter version, an EMA for the ``/metrics`` gauge and MLflow, the
counts the control plane sums, and the version's recent per-step values.

``RollbackJudge`` compares a freshly swapped version's steps with its predecessor's last ones. An
EMA over ~10 steps is no basis for that: a step's accept length depends on the request far more
than on the drafter (suffix drafts on code read 1.2 over one request and 2.3 over the next), and a
demo rolled a learned version back on its first 32 steps against a floor its predecessor had set
on other requests. The judge compares window means in units of consecutive steps (blocks, so
that the steps of one request are not counted as independent evidence) and decides only when the
difference is beyond ``z`` standard errors, or when the watch has run ``max_steps``.

The judge reads the steps that verified drafts only, at their drafting rows (``recent``): a step
the goodput policy decided as plain decoding says nothing about a drafter's acceptance. Counted
as 1.0 tokens, they let the policy's state judge the drafter: a successor the policy had turned
off read exactly 1.000 over 32 steps, a zero-variance window the judge took for certainty, and
three promotions of a 200-request stream were rolled back so.

Of those rows it reads the ones a swap changes: rows drafted by a learned drafter, not by the
suffix index (``NOT_JUDGED``). A swap replaces a hybrid's learned half and keeps its suffix index, so the
suffix rows' accept length says how repetitive the requests are, not how good the version is; and
a better learned half drafts more rows at a learned draft's accept length (~1.2-1.4 here, against
the suffix index's ~2 on code), which lowers the mean over all drafting rows even as it adds
tokens. A demo so rolled back its first promotion ("live accept length 1.400 below floor 1.819"),
after which the restored drafter read the same tokens per verify as the rolled-back one.

The per-version gauges (``specloop_drafter_live_accept_len{version}``, ``_live_acceptance_rate``)
are kept for the versions still relevant: the installed one and the one before it (what a rollback
watch compares), as the Swapper tells them (``track``: it alone knows a rollback from an operator's
swap back to the version before), else as the engine announces them (``on_drafter_change``). A
version that leaves them (a third swap, or a rollback away from it) has its label sets removed, as
``specloop_drafter_info`` does: kept, a rolled-back version read its last value forever (alerts
fired on it), and a refresh promotion every 20 s grew the series without bound. Its in-memory
counts stay until ``take_unflushed`` has delivered them; the last ``RETIRED_KEPT`` retired versions
keep their stats, so a swap back finds them.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge

from feedback.bus.trace import DrafterKind
from serving.engine.base import VerifyBatch
from serving.metrics import once_per_registry
from serving.observers import BaseObserver

# ---- metrics ------------------------------------------------------------------------------------


@dataclass
class Collectors:
    live_accept_len: Gauge
    live_acceptance_rate: Gauge
    swaps: Counter
    rollbacks: Counter
    refused: Counter


@once_per_registry
def collectors(r: CollectorRegistry) -> Collectors:
    """The swap metrics of registry ``r`` (created once per registry)."""
    return Collectors(
        live_accept_len=Gauge(
            "specloop_drafter_live_accept_len",
            "EMA of tokens per verify step and row, per drafter version.",
            ["version"], registry=r,
        ),
        live_acceptance_rate=Gauge(
            "specloop_drafter_live_acceptance_rate",
            "Accepted / drafted tokens since the version went live.",
            ["version"], registry=r,
        ),
        swaps=Counter("specloop_drafter_swaps", "Drafter swaps applied.", registry=r),
        rollbacks=Counter(
            "specloop_drafter_rollbacks", "Automatic or admin rollbacks.", registry=r
        ),
        refused=Counter(
            "specloop_drafter_refused", "Drafter artifacts refused by validation.", registry=r
        ),
    )


# ---- live acceptance ----------------------------------------------------------------------------


RECENT_STEPS = 256
"""Per-step values kept per version: the baseline a successor is judged against."""

NOT_JUDGED = frozenset({int(DrafterKind.NONE), int(DrafterKind.SUFFIX)})
"""Row sources the judge does not read: no draft, or the suffix index (which a swap keeps)."""


@dataclass
class VersionStats:
    ema: float | None = None
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    rows: int = 0
    unflushed: tuple[int, int, int] = (0, 0, 0)
    """drafted, accepted, rows not yet reported to the control plane."""
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT_STEPS), repr=False)
    """The last RECENT_STEPS judged steps' accept lengths at their learned-draft rows (live only;
    snapshots leave it empty)."""
    last: float | None = None
    """The latest step's tokens per row."""
    last_drafted: float | None = None
    """The latest step's accept length over its rows drafted by a learned drafter (None: none)."""

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def snapshot(self) -> VersionStats:
        return VersionStats(self.ema, self.steps, self.drafted, self.accepted, self.rows, last=self.last,
                            last_drafted=self.last_drafted)


RETIRED_KEPT = 4
"""Retired versions whose stats stay in memory once their counts were delivered (the newest)."""


class LiveAcceptance(BaseObserver):
    """Per-version live acceptance from the engine's verify steps (cheap: O(batch) per step).

    ``listener(version, stats)`` is called after each step, on the engine's thread.

    Relevant versions (gauges kept): the installed one and the one before it. A Swapper says which
    they are (``track``); from its first word on, the engine's announcements no longer move them.
    Without one, they follow the engine's ``on_drafter_change``: a change to a new version makes the
    installed one the one before and retires the one that was; a change back to the one before
    (taken for a rollback) retires the version left. Until the engine announced a version (an
    observer added after the engine started), the versions the steps carry stand for the
    announcements."""

    def __init__(self, alpha: float = 0.1, registry: CollectorRegistry | None = None):
        self.alpha = alpha
        self._c = collectors(registry)
        self._stats: dict[str, VersionStats] = {}
        self._lock = threading.Lock()
        self.listener = None
        self._current: str | None = None
        self._previous: str | None = None
        self._announced = False
        self._tracked = False
        """A Swapper said which versions are relevant (``track``)."""
        self._retired: list[str] = []
        """Versions whose gauges were removed, oldest first (their stats may still be here)."""

    @property
    def gauged(self) -> tuple[str, ...]:
        """The versions whose gauges are kept: the installed one, then the one before it."""
        with self._lock:
            return tuple(v for v in (self._current, self._previous) if v is not None)

    def on_drafter_change(self, kind: str, version: str) -> None:
        with self._lock:
            self._announced = True
            if not self._tracked:
                self._change(version)

    def track(self, installed: str, previous: str | None) -> None:
        """The Swapper's word: ``installed`` is live and ``previous`` is what a rollback would
        restore (None after a rollback, or a swap it does not watch). An operator's swap back to
        the version before is a swap: the version it leaves stays ``previous``, gauged, where the
        engine's announcement alone reads as a rollback and retired it. The announcements come
        later (from the step thread), so from here on they no longer move the versions."""
        with self._lock:
            self._announced = self._tracked = True
            self._keep(installed, previous)

    def _change(self, version: str) -> None:
        """``version`` is installed now (caller holds the lock)."""
        current, previous = self._current, self._previous
        if version == current:
            return
        if version == previous:  # back to the one before: a rollback; the version left is done
            self._keep(version, None)
        else:
            self._keep(version, current)

    def _keep(self, current: str, previous: str | None) -> None:
        """``current`` installed after ``previous``: the versions that leave the two are retired, a
        retired one that comes back has its gauges again (caller holds the lock)."""
        for version in (self._current, self._previous):
            if version is not None and version not in (current, previous):
                self._retire(version)
        self._current, self._previous = current, previous
        for version in (current, previous):
            if version in self._retired:
                self._retired.remove(version)
                self._gauge(version)
        self._prune()

    def _gauge(self, version: str) -> None:
        """Set ``version``'s gauges from its stats, if it stepped (caller holds the lock)."""
        s = self._stats.get(version)
        if s is not None and s.ema is not None:
            self._c.live_accept_len.labels(version=version).set(s.ema)
            self._c.live_acceptance_rate.labels(version=version).set(s.acceptance_rate)

    def _retire(self, version: str | None) -> None:
        if version is None:
            return
        for gauge in (self._c.live_accept_len, self._c.live_acceptance_rate):
            try:
                gauge.remove(version)
            except KeyError:  # never stepped
                pass
        if version in self._retired:
            self._retired.remove(version)
        self._retired.append(version)

    def _prune(self) -> None:
        """Forget retired versions beyond the newest RETIRED_KEPT whose counts were delivered."""
        for version in self._retired[:-RETIRED_KEPT]:
            s = self._stats.get(version)
            if s is None or s.unflushed == (0, 0, 0):
                self._stats.pop(version, None)
                self._retired.remove(version)

    def on_step(self, batch: VerifyBatch) -> None:
        rows = len(batch.request_ids)
        if rows == 0:
            return
        # Over Python lists: a few values per step, on the step thread's cold caches, where
        # numpy's reductions and np.isin took ~0.15 ms a step (~1.2 % of a 2-core CPU's step).
        num_drafted, num_accepted = batch.num_drafted.tolist(), batch.num_accepted.tolist()  # [B]
        drafted, accepted = sum(num_drafted), sum(num_accepted)
        value = (accepted + rows) / rows
        judged_accepted = [a for d, a, s in zip(num_drafted, num_accepted, batch.source.tolist())
                           if d > 0 and s not in NOT_JUDGED]  # learned drafts' rows
        judged = 1.0 + sum(judged_accepted) / len(judged_accepted) if judged_accepted else None
        version = batch.drafter_version
        with self._lock:
            if version not in (self._current, self._previous):
                if not self._announced:  # the steps stand for the announcements
                    self._change(version)
                elif version not in self._retired:  # a late step of a version forgotten: counted, not gauged
                    self._retired.append(version)
            s = self._stats.setdefault(version, VersionStats())
            s.ema = value if s.ema is None else s.ema + self.alpha * (value - s.ema)
            s.last = value
            s.last_drafted = judged
            if judged is not None:
                s.recent.append(judged)
            s.steps += 1
            s.drafted += drafted
            s.accepted += accepted
            s.rows += rows
            d, a, r = s.unflushed
            s.unflushed = (d + drafted, a + accepted, r + rows)
            if version in (self._current, self._previous):  # under the lock: not after a retirement
                self._gauge(version)
        if self.listener is not None:
            self.listener(version, s)

    def get(self, version: str) -> VersionStats:
        with self._lock:
            s = self._stats.get(version)
            return s.snapshot() if s else VersionStats()

    def recent(self, version: str) -> list[float]:
        """The version's last RECENT_STEPS judged steps' accept lengths, oldest first."""
        with self._lock:
            s = self._stats.get(version)
            return list(s.recent) if s else []

    def take_unflushed(self) -> dict[str, tuple[VersionStats, tuple[int, int, int]]]:
        """Snapshot of every version with new steps since the last call, with the deltas (a retired
        version's last ones too, once)."""
        out = {}
        with self._lock:
            for version, s in self._stats.items():
                if s.unflushed != (0, 0, 0):
                    out[version] = (s.snapshot(), s.unflushed)
                    s.unflushed = (0, 0, 0)
            self._prune()
        return out


# ---- the rollback test --------------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    rollback: bool
    live: float
    """Mean accept length of the watched version's learned-draft steps (at those rows)."""
    baseline: float
    """The predecessor's mean over its last steps before the swap."""
    floor: float
    """floor_ratio x baseline."""
    stderr: float
    """Standard error of live - floor, from block means."""
    steps: int
    """Drafting steps judged."""
    conclusive: bool
    """False when the watch ran out (max_steps) before the difference was beyond z errors."""
    judged: bool = True
    """False when the watch ran out with too few learned-draft steps to judge (the version is kept)."""

    def describe(self) -> str:
        if not self.judged:
            return f"live accept length {self.live:.3f} over {self.steps} learned-draft steps: too few to judge, kept"
        side = "below" if self.rollback else "not below"
        how = "" if self.conclusive else ", inconclusive at the end of the watch"
        return (f"live accept length {self.live:.3f} {side} floor {self.floor:.3f} "
                f"(+-{self.stderr:.3f}) after {self.steps} learned-draft steps{how}")


def block_means(values: Sequence[float], block: int) -> list[float]:
    """Means of consecutive blocks of ``block`` values (a partial last block is dropped unless it
    is the only one)."""
    n = len(values) // block
    if n == 0:
        return [sum(values) / len(values)] if values else []
    return [sum(values[i * block:(i + 1) * block]) / block for i in range(n)]


def _block_stats(values: Sequence[float], block: int) -> tuple[float, float, int]:
    """(mean, variance of the mean, blocks) from block means of at most ``block`` values, at least
    4 blocks where there are 4 values."""
    means = block_means(values, max(1, min(block, len(values) // 4)))
    m = sum(means) / len(means)
    if len(means) < 2:
        return m, math.inf, len(means)
    var = sum((x - m) ** 2 for x in means) / (len(means) - 1)
    return m, var / len(means), len(means)


@dataclass(frozen=True)
class RollbackJudge:
    """Decides whether a watched version fell below ``floor_ratio`` x its predecessor.

    ``verdict`` returns None while undecided: before ``min_steps`` drafting steps, and after it
    while the watched mean is within ``z`` standard errors of the floor (errors from block means of
    ``block_steps`` steps, at least 4 blocks per side; the watched side's at least the
    predecessor's, so that a few identical values are not taken for certainty). At ``max_steps``
    steps of the version in all (``steps``; drafting or not) it decides on the means if it saw
    ``min_steps`` drafting steps, and otherwise keeps the version: the policy drafted it too rarely
    to judge (three failed probes read 1.000 and rolled a promotion back), and a drafter that
    rarely drafts costs next to nothing."""

    floor_ratio: float = 0.8
    min_steps: int = 64
    max_steps: int = 512
    z: float = 2.0
    block_steps: int = 8

    def verdict(self, baseline: Sequence[float], live: Sequence[float], steps: int | None = None) -> Verdict | None:
        """``baseline``, ``live``: accept lengths of drafting steps; ``steps``: the watched
        version's steps in all (default: ``len(live)``)."""
        n = len(live)
        steps = n if steps is None else max(steps, n)
        if n < self.min_steps:
            if steps < self.max_steps:
                return None
            mean = sum(live) / n if n else 1.0  # the watch ran out with too few drafts to judge: keep
            return Verdict(False, mean, 0.0, 0.0, math.inf, n, False, judged=False)
        live_mean, live_var, live_blocks = _block_stats(live, self.block_steps)
        if len(baseline) < 2:  # nothing to compare with: keep
            return Verdict(False, live_mean, 0.0, 0.0, 0.0, n, True)
        base_mean, base_var, base_blocks = _block_stats(baseline, self.block_steps)
        live_var = max(live_var, base_var * base_blocks / live_blocks)  # a block varies as the predecessor's did
        floor = self.floor_ratio * base_mean
        stderr = math.sqrt(live_var + self.floor_ratio ** 2 * base_var)
        if live_mean + self.z * stderr < floor:
            return Verdict(True, live_mean, base_mean, floor, stderr, n, True)
        if live_mean - self.z * stderr >= floor:
            return Verdict(False, live_mean, base_mean, floor, stderr, n, True)
        if steps >= self.max_steps:
            return Verdict(live_mean < floor, live_mean, base_mean, floor, stderr, n, False)
        return None
