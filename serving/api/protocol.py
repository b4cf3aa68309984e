"""Request and response models of the OpenAI-compatible API, plus specloop's extension fields.

Requests ignore unknown fields (clients send many optional ones) but reject the ones whose meaning
we would silently change (``n > 1``, ``logprobs``, ``echo``, ``best_of > 1``, non-zero penalties, a
``logit_bias``, tools and tool calls in the history, a forced ``tool_choice``, a JSON
``response_format``, audio, web search); their defaults, which many clients send on every request,
are accepted. Metadata that changes no output (``user``, ``store``, ``metadata``, ``service_tier``,
``prediction``) is accepted and ignored. Range checks that
depend on the deployment (max_tokens limit, context length, model name) live in
openai_serving.py.

An unset ``temperature`` is the server's ``default_temperature`` (OpenAI's 1.0; set
SPECLOOP_DEFAULT_TEMPERATURE=0 for greedy by default: reproducible outputs, token-identical to
target-only decoding), and an unset ``max_tokens`` as many tokens as the context leaves, up to the
server's limit (``default_max_tokens``), as OpenAI's chat does.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from serving.engine.base import SpecStats

# Request bodies validate strictly, as OpenAI's API does: "max_tokens": "5" or 5.0, "stream": "true"
# or 1 are a 400 naming the field, not silently converted (an int where a float goes is fine).
STRICT_JSON = ConfigDict(extra="ignore", strict=True)


class StreamOptions(BaseModel):
    model_config = STRICT_JSON

    include_usage: bool = False


def _unicode(text: str) -> str:
    """Reject text that is not Unicode: a lone UTF-16 surrogate (JSON's ``"\\ud83d"``, what a
    client sends after cutting a string inside an emoji) cannot be tokenised."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start]
        raise ValueError(
            f"contains a lone UTF-16 surrogate (\\u{ord(bad):04x}) at character {exc.start}: "
            "not valid Unicode text"
        ) from None
    return text


class _Request(BaseModel):
    model_config = STRICT_JSON

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data):
        """OpenAI's schema makes nearly every field nullable and some clients send them all:
        ``"n": null`` or ``"stream": null`` means the default, not a type error."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data

    model: str | None = Field(None, description="None = the served model")
    max_tokens: int | None = Field(None, ge=1, description="None = server default")
    temperature: float | None = Field(
        None, ge=0.0, le=2.0, allow_inf_nan=False,
        description="None = the server's default_temperature (OpenAI's 1.0 unless configured)"
    )
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1, description="extension; 0 or -1 = no top-k cut")
    stop: list[str] = Field(default_factory=list, description="a string or a list of strings")
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None
    # Extensions.
    train: bool = Field(True, description="False: this request emits no trace")
    tenant: str | None = Field(None, min_length=1, max_length=128)
    domain: str | None = Field(None, max_length=128)
    ignore_eos: bool = False
    # Sampling controls the engines do not implement: accepted at their no-op values only.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] = Field(default_factory=dict)

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v: float, info):
        return _reject_if(v, v != 0.0, f"{info.field_name} other than 0")

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, v: dict):
        return _reject_if(v, bool(v), "logit_bias")

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError(f"only n=1 is supported (got n={n}); send separate requests")
        return n

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, stop):
        return [stop] if isinstance(stop, str) else [] if stop is None else stop

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, stop: list[str]) -> list[str]:
        return [s for s in stop if s]  # an empty stop string would end every request at once

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, v, info):
        # a field check (``stream`` comes first), so that the 400 names the field
        if v is not None and not info.data.get("stream", False):
            raise ValueError("stream_options is only allowed with stream=true")
        return v


def _reject_if(value, bad: bool, what: str):
    if bad:
        raise ValueError(f"{what} is not supported")
    return value


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _single_prompt(cls, prompt):
        """One prompt per request: a string or a token-id list (a one-element batch is unwrapped)."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ValueError(
                    f"batched prompts are not supported (got {len(prompt)}); send one per request"
                )
            prompt = prompt[0]
        if len(prompt) == 0:
            raise ValueError("prompt must not be empty")
        return _unicode(prompt) if isinstance(prompt, str) else prompt

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v):
        return _reject_if(v, v, "echo")

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v):
        return _reject_if(v, v is not None, "logprobs")

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, v):
        return _reject_if(v, v not in (None, 1), "best_of > 1")

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v):
        return _reject_if(v, bool(v), "suffix (insertion)")


class TextPart(BaseModel):
    model_config = STRICT_JSON

    type: Literal["text"]
    text: str

    @field_validator("text")
    @classmethod
    def _text_is_unicode(cls, text: str) -> str:
        return _unicode(text)


class ChatMessage(BaseModel):
    model_config = STRICT_JSON

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict] = Field(default_factory=list)
    tool_call_id: str | None = None

    @field_validator("content")
    @classmethod
    def _content_is_unicode(cls, content):
        return _unicode(content) if isinstance(content, str) else content

    @field_validator("tool_calls", mode="before")
    @classmethod
    def _no_tool_calls(cls, v):
        # Dropped, the model would see an empty assistant turn where the client's history has a
        # call; the chat template renders none of it.
        return [] if v is None else _reject_if(v, bool(v), "an assistant message with tool_calls (function calling)")

    @model_validator(mode="after")
    def _content_unless_assistant(self):
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1, description="alias of max_tokens")
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] = Field(default_factory=list)
    functions: list[dict] = Field(default_factory=list)
    tool_choice: str | dict = "none"
    function_call: str | dict = "none"
    response_format: dict | None = None
    modalities: list[str] = Field(default_factory=lambda: ["text"])
    audio: dict | None = None
    web_search_options: dict | None = None

    @field_validator("tools", "functions")
    @classmethod
    def _no_tools(cls, v: list, info):
        return _reject_if(v, bool(v), f"{info.field_name} (function calling)")

    @field_validator("tool_choice", "function_call")
    @classmethod
    def _no_forced_call(cls, v, info):
        # "auto" with no tools is plain text, as OpenAI answers it; anything else asks for a call.
        return _reject_if(v, v not in ("none", "auto"), f"{info.field_name} {v!r} (function calling)")

    @field_validator("modalities")
    @classmethod
    def _text_only(cls, v: list[str]):
        return _reject_if(v, any(m != "text" for m in v), f"modalities {v} (only text)")

    @field_validator("audio", "web_search_options")
    @classmethod
    def _not_offered(cls, v, info):
        return _reject_if(v, v is not None, info.field_name)

    @field_validator("response_format")
    @classmethod
    def _text_format_only(cls, v: dict | None):
        kind = (v or {}).get("type", "text")
        return _reject_if(v, kind != "text", f"response_format {kind!r} (structured output)")

    @field_validator("top_logprobs")
    @classmethod
    def _no_top_logprobs(cls, v: int | None):
        return _reject_if(v, bool(v), "top_logprobs")

    @field_validator("messages")
    @classmethod
    def _non_empty(cls, messages):
        if not messages:
            raise ValueError("messages must contain at least one message")
        return messages

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v):
        return _reject_if(v, v, "logprobs")

    @field_validator("max_completion_tokens")
    @classmethod
    def _agrees_with_max_tokens(cls, v, info):
        given = info.data.get("max_tokens")
        if v is not None and given is not None and given != v:
            raise ValueError("max_tokens and max_completion_tokens disagree; send one")
        return v

    @model_validator(mode="after")
    def _one_max_tokens(self):
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self


# --------------------------------------------------------------------------- responses


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
