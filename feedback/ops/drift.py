"""Acceptance drift: per domain, live acceptance against its own trailing level.

Each domain keeps two exponential averages of its drafted and accepted token counts (acceptance is
their ratio, so a step that drafted 4 tokens weighs 4x one that drafted 1): a fast one (about the
last ``fast_steps`` steps) and a slow one (about ``slow_steps``). A drift is the fast acceptance
staying below ``(1 - threshold)`` of the slow one for ``persist_steps`` steps in a row, once the
domain has ``min_steps`` steps. It is reported once; the domain re-arms when the fast acceptance is
back above ``(1 - threshold / 2)`` of the level it fell from, and not before ``cooldown_steps``.

Why so much damping: live acceptance is noisy (each request starts cold, prompts differ, k varies
step to step). With per-step rates and short windows the demo's 80 requests raised 34 "drifts"
with no change in traffic. An alarm that fires that often is ignored. Serving logs each drift
(MLflow, Prometheus, the demo's table) and announces it to the trainer, which then trains on that
domain.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Domain:
    fast_drafted: float = 0.0
    fast_accepted: float = 0.0
    slow_drafted: float = 0.0
    slow_accepted: float = 0.0
    steps: int = 0
    below: int = 0  # consecutive steps with fast < (1 - threshold) * slow
    armed: bool = True
    level: float = 0.0
    fired_at: int = -(10**9)

    @property
    def fast(self) -> float:
        return self.fast_accepted / self.fast_drafted if self.fast_drafted > 0 else 0.0

    @property
    def slow(self) -> float:
        return self.slow_accepted / self.slow_drafted if self.slow_drafted > 0 else 0.0


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
    fast_steps: int = 256
    slow_steps: int = 1024
    min_steps: int = 256
    persist_steps: int = 64
    cooldown_steps: int = 512
    domains: dict[str, _Domain] = field(default_factory=dict)

    def observe(self, domain: str, drafted: int, accepted: int) -> DriftEvent | None:
        """One row-step of ``domain``; steps that drafted nothing carry no acceptance signal."""
        if drafted <= 0:
            return None
        d = self.domains.setdefault(domain, _Domain())
        af, as_ = 2.0 / (self.fast_steps + 1), 2.0 / (self.slow_steps + 1)
        if d.steps == 0:
            d.fast_drafted = d.slow_drafted = float(drafted)
            d.fast_accepted = d.slow_accepted = float(accepted)
        else:
            d.fast_drafted += af * (drafted - d.fast_drafted)
            d.fast_accepted += af * (accepted - d.fast_accepted)
            d.slow_drafted += as_ * (drafted - d.slow_drafted)
            d.slow_accepted += as_ * (accepted - d.slow_accepted)
        d.steps += 1
        fast, slow = d.fast, d.slow
        if not d.armed and fast >= (1.0 - self.threshold / 2) * d.level:
            d.armed = True
        d.below = d.below + 1 if slow > 0 and fast < (1.0 - self.threshold) * slow else 0
        if (d.armed and d.steps >= self.min_steps and d.below >= self.persist_steps
                and d.steps - d.fired_at >= self.cooldown_steps):
            d.armed, d.level, d.fired_at = False, slow, d.steps
            return DriftEvent(domain, before=slow, now=fast)
        return None
