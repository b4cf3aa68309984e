"""The trainer loop's settings and its running figures (trainer/loop.py's ``TrainerLoop``)."""

from __future__ import annotations

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
    losses: list[float] = field(default_factory=list)

    @property
    def heldout_acceptance(self) -> float | None:
        """The latest held-out expected acceptance (None before the first evaluation)."""
        return self.curve[-1]["expected_acceptance"] if self.curve else None
