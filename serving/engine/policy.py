"""SpeculationPolicy: how many tokens to draft in the next verify step.

The engine asks the policy once per step and tells it what the step cost and yielded, so an
adaptive policy (goodput-optimal k from live acceptance and measured costs, feedback/goodput.py)
can replace ``FixedK`` without touching the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np


@dataclass
class BatchState:
    """What the policy may look at when choosing k for the next step."""

    batch_size: int
    k_max: int
    """Configured upper bound (EngineConfig.k)."""
    room: np.ndarray
    """[B] int: tokens each row may still emit (max_tokens and context); a row drafts at most
    room - 1 tokens whatever k is."""
    mixed_sources: bool = False
    """The drafter mixes the drafts of several sources (the hybrid: the suffix index's and a
    learned drafter's; ``HybridDrafter.mixes_sources``): an acceptance estimate of its drafts as a
    whole says nothing of one source's best node."""
    branches: int = 1
    """Candidates per drafted position the drafter verifies (a learned drafter's token trees:
    ``LearnedDrafter.branches``): a draft of k positions widens the verify by k x branches nodes."""


@runtime_checkable
class SpeculationPolicy(Protocol):
    def choose_k(self, state: BatchState) -> int:
        """0..state.k_max; 0 = plain target decoding for this step."""
        ...

    def observe(
        self,
        k: int,
        num_drafted: np.ndarray,
        num_accepted: np.ndarray,
        draft_ms: float,
        verify_ms: float,
    ) -> None:
        """After each step: the k chosen, per-row [B] drafted/accepted counts, and the measured
        draft and verify (target forward + accept) times of the whole batch."""
        ...


class FixedK:
    """Always k (capped by the configured maximum)."""

    def __init__(self, k: int):
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        self.k = k

    def choose_k(self, state: BatchState) -> int:
        return min(self.k, state.k_max)

    def observe(self, k, num_drafted, num_accepted, draft_ms, verify_ms) -> None:
        pass
