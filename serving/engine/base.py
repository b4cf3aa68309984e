"""The Engine protocol shared by TorchEngine (embedded, CPU/GPU) and SGLangEngine (production GPU).

Everything that is not "run the model" lives outside the engines and is shared: the HTTP layer
(serving/api), trace recording and metrics (serving/observers.py, fed with VerifyBatch events),
detokenisation and stop strings (serving/output.py), and drafter swaps (serving/swap.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np
from pydantic import BaseModel, Field

from feedback.registry.artifact_keys import DAY0_VERSION
from feedback.target.fingerprint import TargetFingerprint


class SamplingParams(BaseModel):
    temperature: float = Field(0.0, ge=0.0, le=2.0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 = no top-k cut")
    max_tokens: int = Field(128, ge=1)
    stop: list[str] = Field(default_factory=list, description="stop strings (not included in output)")
    stop_token_ids: list[int] = Field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    """False: special tokens the model emits stay in the output text (vLLM's field)."""


@dataclass
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    tenant: str = "default"
    domain: str | None = None
    train: bool = True
    """False: the request emits no trace (per-request opt-out)."""


@dataclass
class SpecStats:
    """Speculative-decoding statistics of one request (also reported in the API's ``usage``)."""

    verify_steps: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def mean_accept_len(self) -> float:
        """Tokens emitted per target forward (accepted drafts + the bonus token)."""
        if self.verify_steps == 0:
            return 0.0
        return (self.accepted_tokens + self.verify_steps) / self.verify_steps

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0


@dataclass
class GenerationChunk:
    """An increment of one request's output, as streamed to the client."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    """"stop" (EOS or stop string/token), "length" (max_tokens or context), "abort"."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    stats: SpecStats = field(default_factory=SpecStats)


@dataclass
class VerifyBatch:
    """One verify step over a batch, already on the CPU (numpy). Engines emit it; observers
    (trace recorder, metrics, live acceptance) consume it. Shapes as in feedback/bus/trace.py, with
    B = rows in this step. ``draft_ids``/``draft_probs`` hold ``num_drafted`` valid entries per row."""

    request_ids: list[str]
    positions: np.ndarray  # [B] int32: output index of the first token emitted by this step
    num_drafted: np.ndarray  # [B] int16
    num_accepted: np.ndarray  # [B] int16
    source: np.ndarray  # [B] uint8 DrafterKind
    draft_ids: np.ndarray  # [B, K] int32
    draft_probs: np.ndarray  # [B, K] float32
    emitted: list[list[int]]  # per row: accepted drafts + bonus token (before stop trimming)
    target_topk_ids: np.ndarray | None = None  # [B, K+1, T] int32
    target_topk_logprobs: np.ndarray | None = None  # [B, K+1, T] float16
    features: list[np.ndarray] | None = None
    """Per row [num_accepted+1, F] uint16 (bf16 bits): target features of kept inputs."""
    draft_ms: float | None = None
    verify_ms: float | None = None
    """Wall time of the step's draft and verify; None: not measured by this engine (SGLang's
    steps come from its scheduler without timings). Consumers skip what is None."""
    trace_ms: float | None = None
    """Wall time the step spent on its trace's target top-k after the verify (None: none was
    computed): capture's own cost on the step thread (``bench capture``)."""
    drafter_version: str = DAY0_VERSION
    feature_layers: tuple[int, ...] = ()
    """HF hidden_states indices concatenated into each ``features`` row (empty when none)."""
    tree_nodes: np.ndarray | None = None
    """[B] int16 drafted tree nodes per row when the step verified token trees (None: chains).
    ``draft_ids``/``num_drafted`` then describe each row's chain view: its accepted path plus the
    first rejected child (serving/engine/tree.py)."""
    tree_ids: np.ndarray | None = None  # [B, N] int32 the drafted tree's tokens, -1 padded
    tree_parents: np.ndarray | None = None  # [B, N] int16 parent node index, -1 root/padding

    @property
    def draft_nodes(self) -> np.ndarray:
        """[B] drafted tokens the target verified per row: a tree's nodes, else ``num_drafted``
        (what a request's ``usage.spec.drafted_tokens`` counts)."""
        return self.num_drafted if self.tree_nodes is None else self.tree_nodes


class RequestError(Exception):
    """Raised from ``generate()`` when one request cannot be served; other requests carry on.

    ``invalid=True``: the request itself is bad (the message says why; HTTP 400). Otherwise the
    engine failed while serving it (HTTP 500)."""

    def __init__(self, message: str, invalid: bool = False):
        super().__init__(message)
        self.invalid = invalid


class RetryLater(RequestError):
    """A request refused before anything of it was served, with when to try again."""

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Overloaded(RetryLater):
    """Raised from ``generate()`` when the engine's bounded queue is full (HTTP 429 with
    ``Retry-After``): the request was not admitted, nothing of it is kept; retry later."""


class Unavailable(RetryLater):
    """Raised from ``generate()`` when the engine is stopping or not running (HTTP 503 with
    ``Retry-After``): nothing of the request was served; another replica, or this one after its
    restart, can take it (what a load balancer retries, unlike a 500)."""


@runtime_checkable
class Engine(Protocol):
    model_name: str
    fingerprint: TargetFingerprint
    max_context: int
    tokenizer: object

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """Stream a request's output; the last chunk has ``finished=True``."""
        ...

    async def abort(self, request_id: str) -> None: ...

    def load(self) -> tuple[int, int]:
        """(requests waiting for a place in the running batch, requests running): what the load
        heartbeat tells the trainer, which trains on spare capacity only (serving/load_report.py)."""
        ...

    @property
    def drafter(self): ...

    def swap_drafter(self, drafter) -> None:
        """Install a new drafter; takes effect between decode steps, in-flight requests keep going."""
        ...
