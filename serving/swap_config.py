"""The Swapper's settings (serving/swap.py): what it watches after a swap, how it polls and logs."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field


@dataclass
class SwapConfig:
    tenant: str = "default"
    watch_steps: int = 64
    """Verify steps with learned drafts of a new version watched before it can be kept (or rolled
    back)."""
    floor_ratio: float = 0.8
    """Roll back when the new version's mean accept length at its learned-draft rows < floor_ratio x
    the previous one's."""
    max_watch_steps: int | None = None
    """Steps of the new version (drafting or not) after which the watch decides on the means even
    if the difference is within the noise (default: 8 x watch_steps)."""
    rollback_z: float = 2.0
    """Standard errors the difference must exceed before the watch decides earlier."""
    poll_interval_s: float = 30.0
    """Fallback polling of the MLflow champion alias (<= 0: no polling)."""
    log_interval_s: float = 10.0
    """Live acceptance to MLflow and Redis counters."""
    ema_alpha: float = 0.1
    load_nice: int = 10
    """Artifacts are downloaded, checked and built on a background thread this much nicer than the
    process (and its tensor work on itself alone): a load competes with the decode steps for the
    same cores (on 2 cores a SmolLM2 standalone load cost ~0.2 s of decoding)."""
    replica_id: str = field(default_factory=lambda: f"replica-{uuid.uuid4().hex[:8]}")
