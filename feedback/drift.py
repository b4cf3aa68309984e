"""Acceptance drift: per domain, live acceptance against its own trailing level.

Each domain keeps two exponential averages of its per-step acceptance (accepted / drafted): a fast
one (the last ~``fast_steps`` steps) and a slow one (~``slow_steps``). A drop of the fast one below
``(1 - threshold)`` of the slow one, once the domain has ``min_steps`` steps, is a drift: reported
once, then re-armed when the fast average is back above the level it fell from. Serving uses it to
log the event (MLflow, Prometheus, the demo's table); the trainer treats a drift as the signal to
train on that domain.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Domain:
    fast: float | None = None
    slow: float | None = None
    steps: int = 0
    armed: bool = True
    level: float = 0.0


@dataclass
class DriftEvent:
    domain: str
    before: float
    now: float

    @property
    def drop(self) -> float:
        return 1.0 - self.now / self.before if self.before > 0 else 0.0


@dataclass
class DriftDetector:
    threshold: float = 0.3
    fast_steps: int = 16
    slow_steps: int = 256
    min_steps: int = 32
    domains: dict[str, _Domain] = field(default_factory=dict)

    def observe(self, domain: str, drafted: int, accepted: int) -> DriftEvent | None:
        if drafted <= 0:
            return None
        rate = accepted / drafted
        d = self.domains.setdefault(domain, _Domain())
        af, as_ = 2.0 / (self.fast_steps + 1), 2.0 / (self.slow_steps + 1)
        d.fast = rate if d.fast is None else d.fast + af * (rate - d.fast)
        d.slow = rate if d.slow is None else d.slow + as_ * (rate - d.slow)
        d.steps += 1
        if d.steps < self.min_steps:
            return None
        if d.armed and d.slow > 0 and d.fast < (1.0 - self.threshold) * d.slow:
            d.armed, d.level = False, d.slow
            return DriftEvent(domain, before=d.slow, now=d.fast)
        if not d.armed and d.fast >= (1.0 - self.threshold / 2) * d.level:
            d.armed = True
        return None
