"""The trainer loop's settings and its running figures (trainer/loop.py's ``TrainerLoop``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from trainer import checkpoint


@dataclass
class LoopConfig:
    tenant: str = "default"
    poll_records: int = 64
    poll_timeout_s: float = 1.0
    min_train_traces: int = 16
    steps_per_round: int = 20
    rounds_per_gate: int = 5
    checkpoint_dir: str | None = None
    """Where checkpoints go: each (tenant, drafter kind, target) in a subdirectory of its own
    (``TrainerLoop.checkpoint_root``); None = none."""
    checkpoint_keep: int = checkpoint.KEEP
    """Complete checkpoints kept (newest first; older ones are the fallback if the newest fails)."""
    lineage: dict = field(default_factory=dict)
    """Static lineage params logged with every candidate (topic, group, ...)."""
    drift_boost: float = 4.0
    """After serving reports a drift on a domain, its traces are sampled this many times more..."""
    drift_rounds: int = 10
    """...for this many trained rounds, and the next round ends with a gate."""
    traffic_window: int | None = 16
    """A domain that is a quarter or more of the latest this many arrivals and at most half that
    share of what training samples is a shift of the traffic to it, focused on like a drift while
    it lasts (trainer/traffic_shift.py). None: only serving's drifts focus training."""


@dataclass
class LoopStats:
    rounds: int = 0
    paused_rounds: int = 0
    train_steps: int = 0
    records_polled: int = 0
    promotions: int = 0
    round_errors: int = 0
    drifts: int = 0
    traffic_shifts: int = 0
    last_decision: str = ""
    curve: list[dict] = field(default_factory=list)
    """One held-out evaluation per trained round: that of the weights the round kept (``fit``
    restores its best on held-out), at the round's ``tokens_seen``."""
    losses: list[float] = field(default_factory=list)
    """Every training step's loss in this process (the gate reads the latest)."""
    step_losses: list[tuple[int, float]] = field(default_factory=list)
    """(global step, loss) of the training steps since the last promotion: the next candidate's
    ``train_loss`` curve."""

    @property
    def heldout_acceptance(self) -> float | None:
        """The held-out expected acceptance of the weights the student kept in the latest trained
        round (its best on held-out, not its last evaluation); None before the first evaluation."""
        return self.curve[-1]["expected_acceptance"] if self.curve else None

    def note_round(self, res, first_step: int) -> None:
        """A trained round: ``res`` is its FitResult (trainer/distill.py), ``first_step`` the global
        step its first training step had."""
        self.rounds += 1
        self.train_steps += res.steps
        self.losses.extend(res.losses)
        self.step_losses.extend(enumerate(res.losses, first_step))
        kept = next((c for c in res.curve if c["step"] == res.best_step), None)  # the weights fit restored
        if kept is None or not math.isfinite(res.best_acceptance):
            return  # no held-out traces: nothing evaluated
        if self.curve and self.curve[-1]["tokens_seen"] == kept["tokens_seen"]:
            self.curve.pop()  # one point per step of the curve: the latest kept weights'
        self.curve.append({**kept, "expected_acceptance": res.best_acceptance})

    def promoted(self) -> None:
        """A promotion: the next candidate's loss curve starts after it."""
        self.promotions += 1
        self.step_losses.clear()

    def candidate_curves(self) -> dict[str, list[tuple[int, float]]]:
        """A candidate run's curves: ``train_loss`` by global step since the last promotion, and
        ``heldout_expected_acceptance`` by training tokens seen, one point per step (the weights kept
        there)."""
        acc = {c["tokens_seen"]: c["expected_acceptance"] for c in self.curve}  # the latest per step
        return {"train_loss": list(self.step_losses), "heldout_expected_acceptance": list(acc.items())}
