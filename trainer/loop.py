"""The trainer's main loop, independent of Ray (trainer/actor.py runs it inside an actor).

One round: poll traces -> replay -> (unless serving is saturated) train a round with early
stopping on held-out acceptance -> checkpoint -> commit offsets. Every few rounds the gate compares
the current student with the champion; a passing candidate is exported, logged and registered in
MLflow, becomes the ``champion`` alias, and is announced on the control plane.

The loop's settings and figures are trainer/loop_config.py; its helpers: control-plane drifts and
rollbacks (trainer/announcements.py), shifts of its own traffic (trainer/traffic_shift.py),
retention and deletion (trainer/retention.py), lineage params (trainer/lineage.py), what a
promotion registers (trainer/promotion.py), checkpoints (trainer/checkpoint.py).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from feedback.background.supervise import LOOPS
from feedback.target.fingerprint import TargetFingerprint
from trainer import checkpoint, retention
from trainer.announcements import Announcements
from trainer.digest import weights_digest
from trainer.distill import DistillConfig, Distiller
from trainer.gate import GateConfig, GateDecision, build_suffix_index, judge
from trainer.lineage import Lineage
from trainer.loop_config import LoopConfig, LoopStats
from trainer.promotion import register_candidate
from trainer.replay import ReplayBuffer
from trainer.traffic_shift import TrafficShift, focus_shifts

log = logging.getLogger(__name__)


class Announcer(Protocol):
    def announce(self, tenant: str, version: str) -> None: ...


Exporter = Callable[[object, Path, TargetFingerprint, dict], None]
"""(student, out_dir, fingerprint, extra) -> writes a drafter artifact directory
(feedback/registry/artifact.py); ``extra`` is what the artifact records beside the weights (the gate's
``heldout_acceptance``, which serving starts the new drafter's acceptance estimate from, and the
champion's ``champion_heldout_acceptance`` on the same traces, the ratio a successor's estimate
scales its predecessor's live one by)."""


class TrainerLoop:
    def __init__(
        self,
        source,
        student,
        fingerprint: TargetFingerprint,
        *,
        loop: LoopConfig | None = None,
        distill: DistillConfig | None = None,
        gate: GateConfig | None = None,
        replay: ReplayBuffer | None = None,
        registry=None,
        announcer: Announcer | None = None,
        exporter: Exporter | None = None,
        saturated: Callable[[], bool] | None = None,
        deletions=None,
        ops=None,
        rollbacks_from=None,
        initial_champion: str | None = None,
    ):
        """``deletions``: data deletion requests (``pending_deletions(tenant) -> [tenant]``,
        ``complete_deletion(tenant)``): feedback.control.plane.ControlPlane; None = ``delete_tenant`` only.
        ``initial_champion``: the version serving starts with when it is ``student`` as given (a
        pre-trained artifact): the first champion, so a candidate must beat it, not suffix-only."""
        self.source = source
        self.fingerprint = fingerprint
        self.cfg = loop or LoopConfig()
        self.gate_cfg = gate or GateConfig()
        self.replay = replay if replay is not None else ReplayBuffer(fingerprint=fingerprint, tenant=self.cfg.tenant)
        self.distiller = Distiller(student, distill)
        self.registry = registry
        self.announcer = announcer
        self.exporter = exporter
        self.saturated = saturated or (lambda: False)
        self.deletions = deletions
        self.ops = ops
        """The trainer's MLflow ops run (feedback/ops/ops_log.py): each round's figures, each gate
        decision with its reason. None: not logged."""
        self.champion = None
        self.champion_version: str | None = None
        self.weights_from_version: str | None = initial_champion
        """The last version promoted in the student's line (rollbacks leave it): what it trains on from."""
        self._champion_since = time.monotonic()
        """When the champion went live here (its age decides a refresh: GateConfig.refresh_after_s)."""
        self._champions: dict[str, object] = {}
        """Recent champions by version (bounded): where a rollback sends the champion back to."""
        if initial_champion is not None:
            self.champion = student.snapshot()
            self.champion_version = initial_champion
            self._champions[initial_champion] = self.champion
        self._refused: dict[str, str] = {}
        """Rolled-back version -> digest of its weights: never re-promoted unchanged."""
        self.announcements = Announcements(self.cfg.tenant, self.cfg.drift_boost, self.cfg.drift_rounds)
        """Drifts and rollbacks from the control plane, queued until the next round applies them."""
        self.traffic = TrafficShift(window=self.cfg.traffic_window) if self.cfg.traffic_window else None
        """The domains of the latest arrivals, against what training samples."""
        self._gate_early = False
        self._paused = False
        self._subscription = rollbacks_from.subscribe(self.on_announcement) if rollbacks_from is not None else None
        """``rollbacks_from``: a ControlPlane; its rollbacks and drifts reach ``on_announcement``."""
        self.stats = LoopStats()
        self._uncheckpointed = 0
        """Records polled since the last commit (not yet in a checkpointed replay)."""
        self.health = LOOPS.register("trainer-rounds")
        """This loop's status: errors, up/down (feedback/background/supervise.py)."""
        self.lineage = Lineage(source, self.cfg.lineage)
        """What each candidate is logged with in MLflow (its trace offsets survive a restart)."""
        self.checkpoint_fault: Callable[[str], None] | None = None
        """Tests only: called at each checkpoint step (see trainer/checkpoint.py)."""
        self.checkpoint_identity = checkpoint.identity(self.cfg.tenant, getattr(student, "kind", None), fingerprint)
        """Whose checkpoints this loop writes and loads (tenant, drafter kind, target): they live in
        a directory of their own under ``checkpoint_dir`` (``checkpoint_root``)."""
        self.checkpoint_root = (checkpoint.open_root(self.cfg.checkpoint_dir, self.checkpoint_identity)
                                if self.cfg.checkpoint_dir else None)
        """This identity's checkpoints, a subdirectory of ``checkpoint_dir`` (None: no checkpoints)."""
        if self.checkpoint_root is not None and checkpoint.exists(self.checkpoint_root):
            self._restore()
        self._trained_tokens = self.replay.tokens_seen if len(self.replay) else -1
        """Training-trace tokens at the last trained round (restored traces count as trained)."""

    @property
    def student(self):
        return self.distiller.student

    # -- one round --------------------------------------------------------------------------
    def run_round(self) -> LoopStats:
        self.apply_rollbacks()
        self.apply_drifts()
        self.apply_retention()
        recs = self.source.poll(self.cfg.poll_records, self.cfg.poll_timeout_s)
        self.stats.records_polled += len(recs)
        self._uncheckpointed += len(recs)
        if not self._uncheckpointed:
            # Nothing polled awaits a checkpoint, but the poll may have moved past messages it
            # dead-lettered: commit those now, or every restart reads (and dead-letters) them again.
            self.source.commit()
        taken = [r for r in recs if self.replay.add(r)]
        self.lineage.note_traces(taken)
        self.apply_traffic_shift([r.domain for r in taken])
        if len(self.replay) < self.cfg.min_train_traces:
            return self.stats  # nothing trained: offsets stay uncommitted, records come back on restart
        if self.replay.tokens_seen == self._trained_tokens:
            # No new training traffic: more steps on the same traces only memorise them (fit already
            # early-stopped on held-out). Going straight back to poll also lets a (re)joining Kafka
            # consumer finish its group join, which needs polls closer together than a round.
            return self.stats
        if self.saturated():
            self._pause_for_serving()
            return self.stats
        self._note_pause(False)
        first_step = self.distiller.global_step
        res = self.distiller.fit(self.replay, self.cfg.steps_per_round, k=self.gate_cfg.k, should_stop=self.saturated)
        self.stats.note_round(res, first_step)
        self._log_round(res)
        gate_due = self.stats.rounds % self.cfg.rounds_per_gate == 0 or self._gate_early
        if res.yielded:
            # Serving saturated mid-round: the steps taken stand and the pause is noted (a burst
            # that began and ended inside one fit was otherwise never seen by operators). The round
            # is unfinished, so the next one trains on these traces again, new traffic or not, and a
            # gate due now (held-out scoring, on the cores serving needs) runs after it.
            self._pause_for_serving()
            self._gate_early = gate_due
        else:
            self._trained_tokens = self.replay.tokens_seen
            if gate_due:
                self._gate_early = False
                self.gate()
        self.save()
        self.source.commit()  # only now: the records are in a checkpointed replay and were trained on
        self._uncheckpointed = 0
        return self.stats

    def _pause_for_serving(self) -> None:
        """A round that serving's load stopped, before training or between its steps."""
        self.stats.paused_rounds += 1
        self._note_pause(True)

    def _note_pause(self, paused: bool) -> None:
        """Operators see when training paused for serving's load, and when it resumed."""
        if paused == self._paused:
            return
        self._paused = paused
        log.info("training %s (serving %s)", "paused" if paused else "resumed",
                 "saturated" if paused else "has spare capacity")
        if self.ops is not None:
            self.ops.event("paused" if paused else "resumed", self.stats.rounds,
                           paused_rounds=self.stats.paused_rounds)

    def _log_round(self, res) -> None:
        if self.ops is None:
            return
        st = self.stats
        m = {"records_polled": st.records_polled, "train_steps": st.train_steps,
             "replay_traces": len(self.replay), "promotions": st.promotions}
        if math.isfinite(res.best_acceptance):  # the kept weights' (fit restores its best), not the last evaluated
            m["heldout_expected_acceptance"] = res.best_acceptance
        if res.losses:
            m["train_loss"] = sum(res.losses) / len(res.losses)
        dead = getattr(self.source, "dead_lettered", None)  # Kafka: undecodable messages so far
        if isinstance(dead, int):
            m["records_dead_lettered"] = dead
        for reason, n in self.replay.rejected.items():  # duplicate | fingerprint | tenant | expired
            m[f"records_refused_{reason}"] = n
        self.ops.metrics(m, st.rounds)

    # -- announcements ----------------------------------------------------------------------
    def on_announcement(self, msg) -> None:
        """Control-plane announcements (any thread): rollbacks and drifts of this tenant."""
        self.announcements.on_announcement(msg)

    def on_rollback(self, msg) -> None:
        """A serving replica rolled ``msg.from_version`` back to ``msg.to_version`` (a
        RollbackAnnouncement; any thread). Applied at the start of the next round."""
        self.announcements.on_rollback(msg)

    def apply_drifts(self) -> int:
        """React to serving's drift reports: sample the drifted domain's traces ``drift_boost``
        times more for ``drift_rounds`` trained rounds, and gate at the end of the next one (a
        drafter that fits the new traffic should not wait for the regular gate)."""
        n = self.announcements.apply_drifts(self.stats.rounds, self.ops)
        if n:
            self._gate_early = True
            self.stats.drifts += n
        self.replay.focus = self.announcements.focus()
        return n

    def apply_traffic_shift(self, arrived_domains: list[str | None]) -> int:
        """Traces of these domains arrived: where the traffic moved to a domain training samples
        little of, focus there as on a drift and gate at the end of the next round
        (trainer/traffic_shift.py). Returns the domains newly focused."""
        if self.traffic is None:
            return 0
        self.traffic.observe(arrived_domains)
        n = focus_shifts(self.traffic, self.replay, self.announcements, self.stats.rounds, self.ops)
        if n:
            self._gate_early = True
            self.stats.traffic_shifts += n
        return n

    def apply_rollbacks(self) -> int:
        """Follow serving's rollbacks: the champion reverts to the version serving went back to
        (when this trainer still holds it; else no champion, so the next gate judges against
        nothing rather than against the rolled-back one), and the rolled-back weights are
        remembered so they are not promoted again unchanged."""
        n = 0
        for msg in self.announcements.take_rollbacks():
            n += 1
            bad = self._champions.get(msg.from_version)
            if bad is None and msg.from_version == self.champion_version:
                bad = self.champion
            if bad is not None:
                self._refused[msg.from_version] = weights_digest(bad)
            back = self._champions.get(msg.to_version)
            self.champion = back
            self._champion_since = time.monotonic()
            self.champion_version = msg.to_version if back is not None else None
            log.warning("serving rolled back %s -> %s (%s): champion is now %s", msg.from_version,
                        msg.to_version, msg.reason, self.champion_version or "none")
            if self.ops is not None:
                self.ops.event("rollback", self.stats.rounds, from_version=msg.from_version,
                               to_version=msg.to_version, reason=msg.reason,
                               champion=self.champion_version or "none")
                self.ops.tag("champion_version", self.champion_version or "none")
        return n

    # -- retention --------------------------------------------------------------------------
    def apply_retention(self) -> int:
        """Drop traces past the replay's ``max_age_s`` and those of tenants whose deletion was
        requested; when anything went, rewrite the checkpoint and delete the older ones (which
        still hold it). Returns the traces dropped."""
        return retention.apply_retention(self.replay, self.deletions, self.cfg.tenant, self._purge,
                                         self._purge_legacy)

    def delete_tenant(self, tenant: str) -> int:
        """Drop ``tenant``'s traces from the replay and from every checkpoint now."""
        dropped = self.replay.delete_tenant(tenant)
        self._purge()
        self._purge_legacy([tenant])
        return dropped

    def _purge_legacy(self, tenants: list[str]) -> None:
        checkpoint.purge_legacy(self.cfg.checkpoint_dir, tenants, self.replay.max_age_s)

    def _purge(self) -> None:
        """Traces were dropped: a checkpoint without them, and none of the older ones."""
        self.save(keep=1)

    def run(self, max_rounds: int | None = None, stop: Callable[[], bool] | None = None) -> LoopStats:
        """Rounds until ``stop()`` (or ``max_rounds``, failed ones included). A round that raises
        (MLflow down during a promotion, a broker error) does not end training: it is counted
        (``specloop_loop_errors_total{loop="trainer-rounds"}``), logged and backed off; its records
        stay in the replay and uncommitted until a later round checkpoints them."""

        def wait(seconds: float) -> None:  # back off, but answer stop() within 0.1 s
            end = time.monotonic() + seconds
            while time.monotonic() < end and not (stop and stop()):
                time.sleep(min(0.1, max(0.0, end - time.monotonic())))

        n = 0
        while (max_rounds is None or n < max_rounds) and not (stop and stop()):
            with self.health.guard(wait):
                self.run_round()
            self.stats.round_errors = self.health.errors
            n += 1
        if self.ops is not None:  # the worker may be killed right after: nothing logged is lost
            self.ops.close() if stop and stop() else self.ops.flush()  # stopped: the run ends FINISHED
        return self.stats

    # -- gate and promotion -----------------------------------------------------------------
    def gate(self) -> GateDecision:
        suffix = build_suffix_index(self.replay.train_records) if self.gate_cfg.hybrid else None
        recent = self.stats.losses[-10 * self.cfg.steps_per_round:]
        age = time.monotonic() - self._champion_since if self.champion is not None else None
        d = judge(self.student, self.champion, self.replay.heldout, self.gate_cfg, suffix=suffix, losses=recent,
                  champion_age_s=age)
        if d.promote:
            digest = weights_digest(self.student)
            if digest in self._refused.values():
                d.promote = False
                d.reason = "unchanged since it was rolled back in serving: not re-promoted"
            elif self.champion is not None and digest == weights_digest(self.champion):
                # a refresh of a champion that no round improved on (each round keeps its best
                # weights on held-out, so a student that never got better is the champion itself):
                # a swap to the same weights costs serving a swap and counts as a fresh drafter
                d.promote = False
                d.reason = "unchanged since the champion (no round improved on it): nothing to swap"
        # logged once decided: an operator's gate_promote = 1 is a promotion, not a passed measure
        self.stats.last_decision = d.reason
        log.info("gate: %s", d.reason)
        if self.ops is not None:
            self.ops.metrics(d.as_metrics(), self.stats.rounds)
            self.ops.event("gate", self.stats.rounds, promote=d.promote, reason=d.reason)
        if d.promote:
            parent, weights_from = self.champion_version, self.weights_from_version
            version = self.promote(d)
            if self.ops is not None:
                self.ops.event("promotion", self.stats.rounds, version=version, parent=parent, weights_from=weights_from)
                self.ops.tag("champion_version", self.champion_version)
        return d

    def promote(self, d: GateDecision) -> str | None:
        """The student becomes the champion, registered in MLflow where there is a registry
        (trainer/promotion.py), and is announced. Returns the registered version (None: local)."""
        version = register_candidate(self, d) if self.registry is not None and self.exporter is not None else None
        self.champion = self.student.snapshot()
        self._champion_since = time.monotonic()
        self.champion_version = self.weights_from_version = version or f"local-{self.stats.promotions + 1}"
        self._champions[self.champion_version] = self.champion
        while len(self._champions) > _CHAMPIONS_KEPT:
            self._champions.pop(next(iter(self._champions)))
        self.stats.promoted()
        if self.announcer is not None:
            self.announcer.announce(self.cfg.tenant, self.champion_version)
        return version

    # -- checkpoints ------------------------------------------------------------------------
    def save(self, keep: int | None = None) -> None:
        """``keep``: checkpoints kept (default the configured depth; 1 after a purge)."""
        if not self.cfg.checkpoint_dir:
            return
        extra = {"champion_version": self.champion_version, "weights_from_version": self.weights_from_version,
                 "lineage_window": self.lineage.window(),
                 "lineage_finished_at": self.lineage.finished_at,
                 "stats": {"rounds": self.stats.rounds, "train_steps": self.stats.train_steps,
                           "promotions": self.stats.promotions}}
        champ = self.champion.trainable_state() if self.champion is not None else None
        checkpoint.save(self.checkpoint_root, self.distiller, self.replay, extra, champion_state=champ,
                        keep=keep or self.cfg.checkpoint_keep, fault=self.checkpoint_fault,
                        ident=self.checkpoint_identity)

    def _restore(self) -> None:
        """Resume from the newest checkpoint that loads (none loads: start fresh)."""
        path, self.distiller, self.replay, meta = checkpoint.restore(self.checkpoint_root, self.distiller, self.replay,
                                                                     self.checkpoint_identity)
        if path is None:
            return
        self.champion_version = meta.get("champion_version")
        self.weights_from_version = meta.get("weights_from_version", self.champion_version)
        self.lineage.restore(meta.get("lineage_window"), meta.get("lineage_finished_at"))
        for k, v in meta.get("stats", {}).items():
            setattr(self.stats, k, v)
        champ = checkpoint.champion_state(path)
        if champ is not None:
            self.champion = self.student.snapshot()
            self.champion.load_trainable(champ)
        log.info("resumed from %s: step %d, %d traces", path, self.distiller.global_step, len(self.replay))


_CHAMPIONS_KEPT = 4

