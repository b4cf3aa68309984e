"""The trainer's main loop, independent of Ray (trainer/actor.py runs it inside an actor).

One round: poll traces -> replay -> (unless serving is saturated) train a round with early
stopping on held-out acceptance -> checkpoint -> commit offsets. Every few rounds the gate compares
the current student with the champion; a passing candidate is exported, logged and registered in
MLflow, becomes the ``champion`` alias, and is announced on the control plane.
"""

from __future__ import annotations

import copy
import logging
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import torch

from feedback.fingerprint import TargetFingerprint
from trainer import checkpoint
from trainer.distill import DistillConfig, Distiller
from trainer.gate import GateConfig, GateDecision, build_suffix_index, judge
from trainer.replay import ReplayBuffer

log = logging.getLogger(__name__)


class Announcer(Protocol):
    def announce(self, tenant: str, version: str) -> None: ...


Exporter = Callable[[object, Path, TargetFingerprint], None]
"""(student, out_dir, fingerprint) -> writes a drafter artifact directory (feedback/artifact.py)."""


@dataclass
class LoopConfig:
    tenant: str = "default"
    poll_records: int = 64
    poll_timeout_s: float = 1.0
    min_train_traces: int = 16
    steps_per_round: int = 20
    rounds_per_gate: int = 5
    checkpoint_dir: str | None = None
    lineage: dict = field(default_factory=dict)
    """Static lineage params logged with every candidate (topic, group, ...)."""


@dataclass
class LoopStats:
    rounds: int = 0
    paused_rounds: int = 0
    train_steps: int = 0
    records_polled: int = 0
    promotions: int = 0
    last_decision: str = ""
    curve: list[dict] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)

    @property
    def heldout_acceptance(self) -> float | None:
        """The latest held-out expected acceptance (None before the first evaluation)."""
        return self.curve[-1]["expected_acceptance"] if self.curve else None


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
    ):
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
        self.champion = None
        self.champion_version: str | None = None
        self.stats = LoopStats()
        self._offsets_since_gate: list = []
        if self.cfg.checkpoint_dir and checkpoint.exists(self._ckpt_path):
            self._restore()
        self._trained_tokens = self.replay.tokens_seen if len(self.replay) else -1
        """Training-trace tokens at the last trained round (restored traces count as trained)."""

    @property
    def student(self):
        return self.distiller.student

    @property
    def _ckpt_path(self) -> Path:
        return Path(self.cfg.checkpoint_dir) / "latest"

    # -- one round --------------------------------------------------------------------------
    def run_round(self) -> LoopStats:
        recs = self.source.poll(self.cfg.poll_records, self.cfg.poll_timeout_s)
        self.stats.records_polled += len(recs)
        self.replay.extend(recs)
        if len(self.replay) < self.cfg.min_train_traces:
            return self.stats  # nothing trained: offsets stay uncommitted, records come back on restart
        if self.replay.tokens_seen == self._trained_tokens:
            # No new training traffic: more steps on the same traces only memorise them (fit already
            # early-stopped on held-out). Going straight back to poll also lets a (re)joining Kafka
            # consumer finish its group join, which needs polls closer together than a round.
            return self.stats
        if self.saturated():
            self.stats.paused_rounds += 1
            return self.stats
        res = self.distiller.fit(self.replay, self.cfg.steps_per_round, k=self.gate_cfg.k, should_stop=self.saturated)
        self.stats.train_steps += res.steps
        self.stats.losses.extend(res.losses)
        self.stats.curve.extend(res.curve[1:])
        self.stats.rounds += 1
        self._trained_tokens = self.replay.tokens_seen
        if self.stats.rounds % self.cfg.rounds_per_gate == 0:
            self.gate()
        self.save()
        self.source.commit()  # only now: the records are in a checkpointed replay and were trained on
        return self.stats

    def run(self, max_rounds: int | None = None, stop: Callable[[], bool] | None = None) -> LoopStats:
        n = 0
        while (max_rounds is None or n < max_rounds) and not (stop and stop()):
            self.run_round()
            n += 1
        return self.stats

    # -- gate and promotion -----------------------------------------------------------------
    def gate(self) -> GateDecision:
        suffix = build_suffix_index(self.replay.train_records) if self.gate_cfg.hybrid else None
        recent = self.stats.losses[-10 * self.cfg.steps_per_round:]
        d = judge(self.student, self.champion, self.replay.heldout, self.gate_cfg, suffix=suffix, losses=recent)
        self.stats.last_decision = d.reason
        log.info("gate: %s", d.reason)
        if d.promote:
            self.promote(d)
        return d

    def promote(self, d: GateDecision) -> str | None:
        version = None
        if self.registry is not None and self.exporter is not None:
            with tempfile.TemporaryDirectory() as tmp:
                self.exporter(self.student, Path(tmp), self.fingerprint)
                params = {**self.cfg.lineage, **self._loss_params(), "parent_version": self.champion_version or "none",
                          "target_fingerprint": self.fingerprint.key(), "tenant": self.cfg.tenant,
                          "drafter_kind": self.student.kind, "train_steps": self.distiller.global_step,
                          "trace_tokens_seen": self.replay.tokens_seen, **self._offset_window()}
                curves = {"train_loss": list(enumerate(self.stats.losses)),
                          "heldout_expected_acceptance": [(c["tokens_seen"], c["expected_acceptance"])
                                                          for c in self.stats.curve]}
                rid = self.registry.log_candidate(self.fingerprint, tmp, params=params, metrics=d.as_metrics(),
                                                  curves=curves)
                version = self.registry.register(self.cfg.tenant, rid).version
        self.champion = copy.deepcopy(self.student)
        self.champion_version = version or f"local-{self.stats.promotions + 1}"
        self.stats.promotions += 1
        if self.announcer is not None:
            self.announcer.announce(self.cfg.tenant, self.champion_version)
        return version

    def _loss_params(self) -> dict:
        c = self.distiller.cfg
        return {"loss": c.loss, "discard_weight": c.discard_weight, "reject_weight": c.reject_weight,
                "ce_weight": c.ce_weight, "lr": c.lr, "weight_decay": c.weight_decay}

    def _offset_window(self) -> dict:
        window = getattr(self.source, "last_window", None) or getattr(self.source, "offset_window", None)
        return {"offset_window": str(window() if callable(window) else window)} if window is not None else {}

    # -- checkpoints ------------------------------------------------------------------------
    def save(self) -> None:
        if not self.cfg.checkpoint_dir:
            return
        extra = {"champion_version": self.champion_version, "stats": {
            "rounds": self.stats.rounds, "train_steps": self.stats.train_steps, "promotions": self.stats.promotions}}
        champ = self.champion.model.state_dict() if self.champion is not None else None
        checkpoint.save(self._ckpt_path, self.distiller, self.replay, extra, champion_state=champ)

    def _restore(self) -> None:
        meta = checkpoint.load(self._ckpt_path, self.distiller, self.replay)
        self.champion_version = meta.get("champion_version")
        for k, v in meta.get("stats", {}).items():
            setattr(self.stats, k, v)
        champ = self._ckpt_path / "champion.pt"
        if champ.exists():
            self.champion = copy.deepcopy(self.student)
            self.champion.model.load_state_dict(torch.load(champ, weights_only=True))
        log.info("resumed from %s: step %d, %d traces", self._ckpt_path, self.distiller.global_step, len(self.replay))
