"""OpenAI response bodies (/v1/completions, /v1/chat/completions, their stream chunks, /v1/models),
with specloop's ``usage.spec`` extension. Requests are serving/api/protocol.py."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, Field

from serving.engine.base import SpecStats


class SpecUsage(BaseModel):
    """The request's speculative-decoding statistics (extension of ``usage``)."""

    verify_steps: int
    drafted_tokens: int = Field(description="drafted tokens the target verified: every node of a "
                                "token tree (SGLang: its proposed drafts). Prometheus' "
                                "specloop_spec_draft_nodes_total counts the same; its "
                                "specloop_spec_drafted_tokens_total counts each step's path only")
    accepted_tokens: int
    mean_accept_len: float = Field(description="tokens emitted per target forward")
    acceptance_rate: float = Field(description="accepted / drafted (lower than a chain's on tree "
                                   "steps: a tree verifies branches that cannot all be accepted)")

    @classmethod
    def of(cls, s: SpecStats) -> SpecUsage:
        return cls(
            verify_steps=s.verify_steps,
            drafted_tokens=s.drafted_tokens,
            accepted_tokens=s.accepted_tokens,
            mean_accept_len=round(s.mean_accept_len, 4),
            acceptance_rate=round(s.acceptance_rate, 4),
        )


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    spec: SpecUsage


FinishReason = Literal["stop", "length"]
"""OpenAI's; an engine's "abort" is a 503 instead (OpenAIServing.generate)."""


def now_s() -> int:
    """The ``created`` stamp: taken once per request (every chunk of a stream carries it)."""
    return int(time.time())


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: FinishReason | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: FinishReason | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    """One SSE event of a streamed chat completion. The optional last one (include_usage) has
    ``choices == []`` and the usage; every other one has ``usage: null``."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now_s)
    owned_by: str = "specloop"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
