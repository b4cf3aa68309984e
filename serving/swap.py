"""Hot drafter swaps with automatic rollback, shared by every engine.

The ``Swapper`` learns of new drafter versions from the Redis control plane (announcements) with
the MLflow ``champion`` alias polled as a fallback, downloads and validates the artifact (target
fingerprint, checksum, shapes, finite weights: ``feedback.registry.artifact.load_drafter``), and installs it
with ``Engine.swap_drafter`` (between decode steps; in-flight requests keep going). It only needs the
Engine protocol and the StepObserver stream: ``LiveAcceptance`` (an observer the engine must be
given) tracks each version's live acceptance.

Live acceptance = mean tokens emitted per verify step and row (accepted drafts + 1), per drafter
version (serving/live_acceptance.py); its EMA is the ``/metrics`` gauge and, per replica, the
MLflow ``live_accept_len.<replica id>`` metric. After a swap the new version is watched
(serving/swap_watch.py): from ``watch_steps`` verify steps with learned drafts on,
``RollbackJudge`` compares their mean accept length at those rows with ``floor_ratio`` x that of
the previous version's last such steps (suffix-index rows are not read: a swap keeps the index),
and decides once the difference is beyond ``rollback_z`` standard errors (or at
``max_watch_steps``); the verdict is logged on the version's run. On a rollback the Swapper swaps
the previous drafter back, moves the alias back (or takes it off, back to the day-0 drafter the
registry does not hold), announces the rollback on Redis, counts it and tags the version in
MLflow. Other replicas follow (serving/swap_follow.py, with the announcements and the alias). A
version's freshness is logged at its first swap after its promotion (``SwapFreshness``).

Redis or MLflow being down never stops serving: the engine keeps the drafter it has, failures are
logged (once per outage) and retried at the next announcement or poll.

Its errors are in serving/swap_errors.py; versions are downloaded and checked in
serving/registry_fetch.py, and become drafters in serving/artifact_loader.py.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from feedback.background.supervise import SupervisedThread
from serving.live_acceptance import LiveAcceptance, RollbackJudge, collectors
from serving.registry_fetch import RegistryFetch, is_registry_version, registry_version
from serving.registry_records import RegistryRecords, SwapFreshness
from serving.swap_config import SwapConfig
from serving.swap_errors import NothingToRollBack, RefusedArtifact
from serving.swap_follow import SwapFollower
from serving.swap_watch import SwapWatch, verdict_metrics

if TYPE_CHECKING:  # annotation only: the Swapper takes any loader (SGLang's too)
    from serving.artifact_loader import ArtifactDrafterLoader

log = logging.getLogger(__name__)


# ---- the swapper --------------------------------------------------------------------------------


@dataclass
class _Installed:
    version: str
    drafter: object


class Swapper(SwapFollower):
    """See the module docstring. ``engine``: any Engine; ``live``: the LiveAcceptance observer the
    engine reports to; ``registry``: feedback.registry.drafter_registry.DrafterRegistry or None; ``control``:
    feedback.control.plane.ControlPlane or None; ``version``: the registry version of the drafter the
    engine starts with (default: its own ``version`` attribute, e.g. "day0")."""

    def __init__(
        self,
        engine,
        loader: ArtifactDrafterLoader,
        live: LiveAcceptance,
        *,
        registry=None,
        control=None,
        config: SwapConfig | None = None,
        metrics_registry: CollectorRegistry | None = None,
        version: str | None = None,
    ):
        self.engine, self.live = engine, live
        self.registry, self.control = registry, control
        self.config = config or SwapConfig()
        self._c = collectors(metrics_registry)
        drafter = engine.drafter
        start_version = version or getattr(drafter, "version", None) or "none"
        self._start = self._current = _Installed(start_version, drafter)
        """``_start``: the drafter it started with (day 0), kept to go back to when another
        replica rolls back to it."""
        self._previous: _Installed | None = None
        self._rejected: dict[str, str] = {}  # version -> why (refused or rolled back)
        self._last_champion: str | None = None
        self._freshness = SwapFreshness()
        self._op_lock = threading.RLock()
        """Held while the installed drafter, its predecessor and the watch change (never over I/O)."""
        self._load_lock = threading.Lock()
        """One download at a time (swap_to)."""
        self._inbox: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread: SupervisedThread | None = None
        self._subscription = None
        self._warned: set[str] = set()
        self.fetch = RegistryFetch(registry, loader, self.config.tenant, self.config.load_nice)
        self.records = RegistryRecords(registry, self.config.tenant, self.config.load_nice,
                                       self._on_record)
        self.swaps = 0
        self.rollbacks = 0
        self.refused = 0
        self.events: list[dict] = []
        """Swap / rollback / refusal log (newest last), for operators, tests and the demo."""
        c = self.config
        judge = RollbackJudge(
            floor_ratio=c.floor_ratio, min_steps=c.watch_steps, z=c.rollback_z,
            max_steps=c.max_watch_steps if c.max_watch_steps is not None else 8 * c.watch_steps)
        self._watch = SwapWatch(  # the verdict on the version's run; a rollback on a thread of its own
            judge, decided=lambda version, v: self.records.note_metrics(version, verdict_metrics(v)),
            rollback=lambda version, v: self.rollback(reason=v.describe(), live=v.live, floor=v.floor,
                                                      from_version=version),
            kept=lambda version, v: self._inbox.put(("kept", (version, v))))
        live.listener = self._watch.on_step

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            return
        if self.control is not None:
            self._subscription = self.control.subscribe(lambda msg: self._inbox.put(("announce", msg)))
        self._stop.clear()
        self._thread = SupervisedThread("drafter-swapper", self._run, self._stop)
        self._thread.start()  # after the assignment: _run reads self._thread.status

    def stop(self) -> None:
        self._stop.set()
        self._inbox.put(("stop", None))
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        if self._subscription is not None:
            self._subscription.close()
            self._subscription = None
        self.fetch.stop()
        self._flush_live()
        self.records.flush()
        self.records.stop()

    def wait_subscribed(self, timeout: float = 5.0) -> bool:
        return self._subscription is not None and self._subscription.wait_subscribed(timeout)

    # ---- state ----------------------------------------------------------------------------

    @property
    def loader(self) -> ArtifactDrafterLoader:
        """What turns a downloaded artifact into a drafter (the fetch's)."""
        return self.fetch.loader

    @property
    def version(self) -> str:
        return self._current.version

    def status(self) -> dict:
        cur, prev = self._current, self._previous
        stats = self.live.get(cur.version)
        return {
            "version": cur.version,
            "kind": getattr(cur.drafter, "kind", None),
            "previous_version": prev.version if prev else None,
            "live_accept_len": stats.ema,
            "live_acceptance_rate": stats.acceptance_rate if stats.drafted else None,
            "live_steps": stats.steps,
            "watching": self._watch.watching,
            "swaps": self.swaps,
            "rollbacks": self.rollbacks,
            "refused": self.refused,
        }

    # ---- operations (thread-safe; the admin API calls them from a worker thread) ------------

    def swap_to(self, version: str, *, reason: str = "admin", force: bool = True,
                watch: bool = True) -> dict:
        """Download, validate and install ``version``. Raises UnknownVersion, RefusedArtifact or
        RegistryUnavailable; the engine keeps its drafter on any error. The download runs outside
        the lock a rollback takes (one download at a time), so a rollback, an operator's or the
        watch's, never waits on a slow registry. ``watch=False``: neither watched nor rolled back
        to the drafter it replaces (following another replica's rollback of that one)."""
        version = str(version)
        with self._load_lock:
            with self._op_lock:
                if version != self._current.version:  # the running one may be none ("day0")
                    version = registry_version(version)
                if (unchanged := self._unchanged(version, reason, force)) is not None:
                    return unchanged
                beside = self._current.drafter
            # (a rollback meanwhile leaves the new drafter built beside the one rolled back from:
            # the suffix index is the same object, only the learned half's starting estimate differs)
            drafter = self._load(version, beside)
            with self._op_lock:  # what happened meanwhile (a rollback, a refusal elsewhere) counts
                if (unchanged := self._unchanged(version, reason, force)) is not None:
                    return unchanged
                old = self._current
                self._install(_Installed(version, drafter), old if watch else None)
                if watch:
                    self._watch.begin(version, self.live.recent(old.version))
                else:
                    self._watch.end()
                self._rejected.pop(version, None)
                self.swaps += 1
                self._c.swaps.inc()
                fresh = self._freshness.swapped_in(version, reason, drafter)
                self._event("swap", version=version, previous_version=old.version, reason=reason,
                            **fresh)
                self.records.note_event(version, f"swapped in on {self.config.replica_id} ({reason})")
                if fresh:
                    self.records.note_metrics(version, fresh)
        log.info("drafter %s -> %s (%s)", old.version, version, reason)
        return {"version": version, "previous_version": old.version, "changed": True}

    def _unchanged(self, version: str, reason: str, force: bool) -> dict | None:
        """The answer of a swap to ``version`` that changes nothing, or None (caller holds _op_lock)."""
        if version == self._current.version:
            return {"version": version, "previous_version": None, "changed": False}
        if not force and version in self._rejected:
            log.info("ignoring %s for drafter %s: %s earlier", reason, version, self._rejected[version])
            return {"version": self._current.version, "previous_version": None, "changed": False}
        return None

    def rollback(self, *, reason: str = "admin", live: float | None = None,
                 floor: float | None = None, from_version: str | None = None) -> dict:
        """Reinstall the previous drafter, move the alias back and announce it."""
        from feedback.control.plane import RollbackAnnouncement

        with self._op_lock:
            bad, prev = self._current, self._previous
            if from_version is not None and bad.version != from_version:
                raise NothingToRollBack(f"version {bad.version} is live, not {from_version}: "
                                        "nothing rolled back")
            if prev is None:
                raise NothingToRollBack("no previous drafter to roll back to")
            self._install(prev, None)
            self._watch.end()
            self._rejected[bad.version] = "rolled back"
            self._last_champion = prev.version
            self.rollbacks += 1
            self._c.rollbacks.inc()
            self._event("rollback", from_version=bad.version, to_version=prev.version,
                        reason=reason, live=live, floor=floor)
            log.warning("drafter rolled back %s -> %s: %s", bad.version, prev.version, reason)
        # the alias back on the version restored, or off (a drafter the registry does not hold):
        # left on the one rolled back, a replica started later would swap it in again
        registered = prev.version in self.fetch.seen or is_registry_version(prev.version)
        self.records.move_champion(bad.version, prev.version if registered else None)
        self.records.note_event(bad.version, f"rolled back on {self.config.replica_id}: {reason}")
        if self.control is not None:
            self.control.announce_rollback(RollbackAnnouncement(
                tenant=self.config.tenant, from_version=bad.version, to_version=prev.version,
                reason=reason, live_acceptance=live, floor=floor, replica_id=self.config.replica_id))
        return {"from_version": bad.version, "to_version": prev.version}

    # ---- internals ------------------------------------------------------------------------

    def _load(self, version: str, beside):
        """``version``'s drafter, fetched on the background loader thread and built beside the
        drafter ``beside`` (whose frozen parts it may share); a refusal is counted, logged and
        noted on the version before it is raised."""
        try:
            drafter = self.fetch.fetch(version, beside)
        except RefusedArtifact as e:
            why = e.__cause__
            with self._op_lock:
                self.refused += 1
                self._c.refused.inc()
                self._rejected[version] = "refused"
            self._event("refused", version=version, reason=str(why))
            log.error("drafter version %s refused: %s", version, why)
            self.records.note_event(version, f"refused on {self.config.replica_id}: {why}"[:4900])
            raise
        drafter.version = version  # traces, metrics and MLflow all speak registry versions
        return drafter

    def _install(self, installed: _Installed, previous: _Installed | None) -> None:
        """Install ``installed``, after ``previous`` (what a rollback restores; None: nothing). The
        live gauges follow this state (``LiveAcceptance.track``), not the engine's announcements,
        which cannot tell a rollback from an operator's swap back to the version before."""
        self.engine.swap_drafter(installed.drafter)
        self._current, self._previous = installed, previous
        self.live.track(installed.version, previous.version if previous is not None else None)

    def _run(self) -> None:
        cfg = self.config
        status = self._thread.status
        next_poll = time.monotonic() if cfg.poll_interval_s > 0 else float("inf")
        next_log = time.monotonic() + cfg.log_interval_s
        while not self._stop.is_set():
            timeout = max(0.0, min(next_poll, next_log) - time.monotonic())
            try:
                kind, payload = self._inbox.get(timeout=min(timeout, 1.0))
            except queue.Empty:
                kind, payload = None, None
            try:
                if kind == "stop":
                    break
                if kind == "announce":
                    self._on_announcement(payload)
                elif kind == "kept":
                    version, v = payload
                    self._event("kept", version=version, live=v.live, baseline=v.baseline,
                                floor=v.floor, steps=v.steps, reason=v.describe())
                    self.records.note_event(version, f"kept on {self.config.replica_id}: {v.describe()}")
                now = time.monotonic()
                if now >= next_poll:
                    next_poll = now + cfg.poll_interval_s
                    self.poll_once()
                if now >= next_log:
                    next_log = now + cfg.log_interval_s
                    self._flush_live()
                status.ok()
            except Exception as e:  # noqa: BLE001 - never let the worker die; serving goes on
                self._stop.wait(status.failed(e))  # counted, logged, /health down until it recovers

    def _flush_live(self) -> None:
        """Every ``log_interval_s`` and at stop: live acceptance, the events noted since and an
        alias move still to be done."""
        self.records.write_events()
        for version, (stats, (drafted, accepted, rows)) in self.live.take_unflushed().items():
            if self.control is not None:
                self.control.record_acceptance(self.config.tenant, version, drafted, accepted, rows)
            if version in self.fetch.seen and stats.ema is not None:  # one curve per replica
                self.records.write("log_live_acceptance", version, stats.ema, stats.steps,
                                   self.config.replica_id)

    def _on_record(self, method: str, error: Exception | None) -> None:
        if error is None:
            self._warned.discard("mlflow")
        else:
            self._warn_once("mlflow", f"MLflow {method} failed: {error}")

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("%s (serving continues with drafter %s)", message, self._current.version)

    def _event(self, kind: str, **data) -> None:
        self.events.append({"event": kind, "at": time.time(), **data})
        del self.events[:-200]
