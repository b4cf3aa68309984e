"""TraceRecord: what one finished request teaches the drafter.

One record per finished request (not per step: the broker moves ~2.7k msgs/s here). Per verify step
it keeps the drafted ids, the draft's probability of each, how many were accepted, which drafter
proposed them, and the target's top-k (ids, logprobs) at all k+1 verified positions, including the
positions after the first rejection (the "discarded" branch, free training signal).

Array layout (S = verify steps, K = max drafted tokens in any step of this request, T = top-k):
    step_positions   [S]        int32   index in output_ids of the first token this step emitted
    step_num_drafted [S]        int16   drafted tokens in this step (0..K)
    step_num_accepted[S]        int16   accepted drafted tokens (0..num_drafted); emitted = accepted+1
    step_source      [S]        uint8   DrafterKind of the proposal (NONE when nothing was drafted)
    draft_ids        [S, K]     int32   drafted ids, -1 padded
    draft_probs      [S, K]     float32 draft probability q(x) of each drafted id (1.0 for model-free,
                                        NaN where the engine did not keep q: SGLang)
    target_topk_ids  [S, K+1, T] int32  target's top-k ids at each verified position, -1 padded
    target_topk_logprobs [S, K+1, T] float16 their log-probabilities (full-vocab log-softmax)
    hidden_states    [N, F] uint16 (bf16 bits) optional target features at prompt+output positions
    tree_ids         [S, M]     int32   optional (codec 1.1): the token tree drafted at each step
                                        (M = most nodes), -1 padded; a row of -1 = a chain step
    tree_parents     [S, M]     int16   optional: parent of each tree node as a node index, -1 for a
                                        child of the step's root (the last committed token)

Token-tree steps: ``draft_ids``/``num_drafted``/``target_topk_*`` hold the step's chain view, the
accepted path plus the first rejected child of its last node (what a chain step with those drafts
verifies), so everything above keeps its meaning; ``tree_ids``/``tree_parents`` add the whole tree.

Row j of target_topk_* at step s is the target's distribution for the token at output position
``step_positions[s] + j`` given the context prompt + output[:pos] + draft_ids[s, :j]. For
j <= num_accepted that context is the real output; for j > num_accepted it is the discarded branch.
"""

from __future__ import annotations

import enum
import time

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from feedback.target.fingerprint import TargetFingerprint

TRACE_SCHEMA_VERSION = 1


class DrafterKind(enum.IntEnum):
    NONE = 0
    SUFFIX = 1
    EAGLE = 2
    STANDALONE = 3
    SELFSPEC = 4

    @classmethod
    def parse(cls, name: str) -> DrafterKind:
        return cls[name.upper()]


class StepArrays(BaseModel):
    """Per-verify-step arrays of one request (see module docstring for shapes)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    positions: np.ndarray
    num_drafted: np.ndarray
    num_accepted: np.ndarray
    source: np.ndarray
    draft_ids: np.ndarray
    draft_probs: np.ndarray
    target_topk_ids: np.ndarray
    target_topk_logprobs: np.ndarray
    tree_ids: np.ndarray | None = None
    tree_parents: np.ndarray | None = None

    @property
    def num_steps(self) -> int:
        return int(self.positions.shape[0])

    @model_validator(mode="after")
    def _check_shapes(self) -> StepArrays:
        if self.positions.ndim != 1:
            raise ValueError(f"positions must be [S], got {self.positions.shape}")
        s = self.positions.shape[0]
        for name in ("num_drafted", "num_accepted", "source"):
            arr = getattr(self, name)
            if arr.shape != (s,):
                raise ValueError(f"{name} must have shape ({s},), got {arr.shape}")
        if self.draft_ids.ndim != 2 or self.draft_ids.shape[0] != s:
            raise ValueError(f"draft_ids must be [S, K], got {self.draft_ids.shape}")
        k = self.draft_ids.shape[1]
        if self.draft_probs.shape != (s, k):
            raise ValueError(f"draft_probs must be {(s, k)}, got {self.draft_probs.shape}")
        if self.target_topk_ids.ndim != 3 or self.target_topk_ids.shape[:2] != (s, k + 1):
            raise ValueError(f"target_topk_ids must be [S, K+1, T], got {self.target_topk_ids.shape}")
        if self.target_topk_logprobs.shape != self.target_topk_ids.shape:
            raise ValueError("target_topk_logprobs must match target_topk_ids")
        if np.any(self.num_accepted > self.num_drafted):
            raise ValueError("num_accepted exceeds num_drafted")
        if (self.tree_ids is None) != (self.tree_parents is None):
            raise ValueError("tree_ids and tree_parents come together")
        if self.tree_ids is not None:
            if self.tree_ids.ndim != 2 or self.tree_ids.shape[0] != s:
                raise ValueError(f"tree_ids must be [S, M], got {self.tree_ids.shape}")
            if self.tree_parents.shape != self.tree_ids.shape:
                raise ValueError("tree_parents must match tree_ids")
            m = self.tree_ids.shape[1]
            own = np.arange(m)[None, :]
            if np.any((self.tree_parents < -1) | (self.tree_parents >= own)):
                raise ValueError("a tree node's parent must be an earlier node or -1")
        return self


class TraceRecord(BaseModel):
    """One finished request, as the trainer sees it."""

    model_config = ConfigDict(arbitrary_types_allowed=True, allow_inf_nan=False)

    schema_version: int = TRACE_SCHEMA_VERSION
    request_id: str
    tenant: str = "default"
    domain: str | None = None
    created_at: float = Field(default_factory=time.time)
    finished_at: float = Field(default_factory=time.time)
    target: TargetFingerprint
    drafter_kind: str
    """Deployment drafter kind (suffix|eagle|standalone|hybrid)."""
    drafter_version: str
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    finish_reason: str = "length"
    prompt_ids: np.ndarray
    output_ids: np.ndarray
    steps: StepArrays
    hidden_states: np.ndarray | None = None
    """Optional [len(prompt)+len(output), F] target features as bf16 bits (uint16)."""
    hidden_layers: tuple[int, ...] = ()
    """Which target layers were concatenated into each hidden_states row."""

    @model_validator(mode="after")
    def _check(self) -> TraceRecord:
        for name in ("prompt_ids", "output_ids"):
            if getattr(self, name).ndim != 1:
                raise ValueError(f"{name} must be one-dimensional, got {getattr(self, name).shape}")
        emitted = int((self.steps.num_accepted.astype(np.int64) + 1).sum())
        if emitted != len(self.output_ids):
            raise ValueError(
                f"steps emit {emitted} tokens but output has {len(self.output_ids)}"
            )
        if self.hidden_states is not None:
            n = len(self.prompt_ids) + len(self.output_ids)
            if self.hidden_states.ndim != 2 or self.hidden_states.shape[0] not in (n, n - 1):
                raise ValueError(f"hidden_states must be [{n} or {n - 1}, F], got {self.hidden_states.shape}")
        return self

    @property
    def num_drafted(self) -> int:
        return int(self.steps.num_drafted.sum())

    @property
    def num_accepted(self) -> int:
        return int(self.steps.num_accepted.sum())
