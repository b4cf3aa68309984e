"""Request and response models of the OpenAI-compatible API, plus specloop's extension fields.

Requests ignore unknown fields (clients send many optional ones) but reject the ones whose meaning
we would silently change (``n > 1``, ``logprobs``, ``echo``, ``best_of > 1``, non-zero penalties, a
``logit_bias``, tools, tool calls and tool messages in the history, a forced ``tool_choice``, a
JSON ``response_format``, audio, web search, image or other non-text content parts, and vLLM's
and SGLang's extensions the engines do not implement: ``_Request.UNSUPPORTED``); their defaults,
which many clients send on every request, are accepted. A null, at any depth, is the default.
Metadata that changes no output (``user``, ``store``, ``metadata``, ``service_tier``,
``prediction``) is accepted and ignored. Range checks that depend on the deployment (max_tokens
limit, context length, model name, vocabulary) live in openai_serving.py.

An unset ``temperature`` is the server's ``default_temperature`` (OpenAI's 1.0; set
SPECLOOP_DEFAULT_TEMPERATURE=0 for greedy by default: reproducible outputs, token-identical to
target-only decoding). An unset ``max_tokens`` is the server's ``default_max_tokens`` where set,
else as many tokens as the context leaves (up to the server's limit) on chat, as OpenAI's chat
does, and COMPLETION_DEFAULT_MAX_TOKENS on /v1/completions, as OpenAI's legacy completions and
vLLM do.
"""

from __future__ import annotations

import json
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

# Request bodies validate strictly, as OpenAI's API does: "max_tokens": "5" or 5.0, "stream": "true"
# or 1 are a 400 naming the field, not silently converted (an int where a float goes is fine).
STRICT_JSON = ConfigDict(extra="ignore", strict=True)

COMPLETION_DEFAULT_MAX_TOKENS = 16
"""/v1/completions' max_tokens when neither the request nor the server sets one (OpenAI's, vLLM's)."""
MAX_STOP_STRINGS = 16
"""Stop strings per request (OpenAI allows 4; vLLM any number)."""
MAX_STOP_CHARS = 1024
"""Characters per stop string. Matching costs each step its new text whatever the stop strings'
lengths (serving/output.py); the bounds keep a request's matcher state small."""
_OFF = object()  # UNSUPPORTED's no-op for fields that are a no-op only when unset, null or empty


def _without_nulls(data):
    """OpenAI's schema makes nearly every field nullable, nested ones too, and some clients send
    them all: ``"n": null`` or ``"stream_options": {"include_usage": null}`` means the default,
    not a type error."""
    return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class _Body(BaseModel):
    """A JSON object of a request body: strict types, unknown fields ignored, null = the default."""

    model_config = STRICT_JSON

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data):
        return _without_nulls(data)


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    """vLLM's: usage in every chunk. Not sent; refused rather than silently dropped."""

    @field_validator("continuous_usage_stats")
    @classmethod
    def _no_usage_per_chunk(cls, v: bool):
        return _reject_if(v, v, "stream_options.continuous_usage_stats (usage in every chunk)")


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


class _Request(_Body):
    UNSUPPORTED: ClassVar[dict[str, object]] = {
        "presence_penalty": 0.0, "frequency_penalty": 0.0, "logit_bias": _OFF,
        # vLLM's and SGLang's extensions
        "min_tokens": 0, "repetition_penalty": 1.0, "min_p": 0.0, "no_stop_trim": False,
        "include_stop_str_in_output": False,
        "spaces_between_special_tokens": True, "use_beam_search": False, "length_penalty": 1.0,
        "return_tokens_as_token_ids": False, "return_hidden_states": False, "priority": 0,
        **dict.fromkeys(("truncate_prompt_tokens", "prompt_logprobs", "allowed_token_ids",
                         "bad_words", "logits_processors", "guided_json", "guided_regex",
                         "guided_choice", "guided_grammar", "structural_tag", "regex", "ebnf",
                         "json_schema", "lora_path"), _OFF),
    }
    """Controls the engines do not implement, each with its no-op value (what many clients send on
    every request): another value is a 400 naming the field, as ignored it would change the
    output unasked (``priority``: the scheduling; vLLM refuses it without a priority scheduler)."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data):
        """``_Body``'s, then refuses an UNSUPPORTED control sent at another value than its
        no-op one."""
        data = _without_nulls(data)
        if not isinstance(data, dict):
            return data
        for name in filter(cls.UNSUPPORTED.__contains__, data):
            noop, value = cls.UNSUPPORTED[name], data[name]
            if value in ([], {}, "") if noop is _OFF else (
                    value == noop and isinstance(value, bool) == isinstance(noop, bool)):
                continue
            what = name if noop is _OFF else f"{name} other than {json.dumps(noop)}"
            raise PydanticCustomError("unsupported_field", "{what} is not supported",
                                      {"field": name, "what": what})
        return data

    model: str | None = Field(None, description="None = the served model")
    max_tokens: int | None = Field(None, ge=1, description="None = server default")
    temperature: float | None = Field(
        None, ge=0.0, le=2.0, allow_inf_nan=False,
        description="None = the server's default_temperature (OpenAI's 1.0 unless configured)"
    )
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1, description="extension; 0 or -1 = no top-k cut")
    stop: list[str] = Field(
        default_factory=list,
        description=f"a string or a list of at most {MAX_STOP_STRINGS} strings of at most "
        f"{MAX_STOP_CHARS} characters",
    )
    stop_token_ids: list[int] = Field(
        default_factory=list, description="extension (vLLM's, SGLang's): token ids that end the "
        "request as EOS does (counted in usage, not in the text)"
    )
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
    skip_special_tokens: bool = Field(True, description="False: special tokens stay in the text")
    response_format: dict | None = None

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
    def _bounded_stops(cls, stop: list[str]) -> list[str]:
        stop = [s for s in stop if s]  # an empty stop string would end every request at once
        if len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are supported (got {len(stop)})")
        longest = max(map(len, stop), default=0)
        if longest > MAX_STOP_CHARS:
            raise ValueError(f"stop strings of at most {MAX_STOP_CHARS} characters are supported "
                             f"(got one of {longest})")
        return stop

    @field_validator("response_format")
    @classmethod
    def _text_format_only(cls, v: dict | None):
        kind = (v or {}).get("type") or "text"
        return _reject_if(v, kind != "text", f"response_format {kind!r} (structured output)")

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
    UNSUPPORTED: ClassVar[dict[str, object]] = {
        **_Request.UNSUPPORTED, "echo": False, "best_of": 1, "logprobs": _OFF, "suffix": _OFF,
        "add_special_tokens": True,
    }

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(
        None, ge=1, description=f"None = the server's default_max_tokens, else "
        f"{COMPLETION_DEFAULT_MAX_TOKENS} (OpenAI's and vLLM's default)"
    )

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


class TextPart(_Body):
    type: Literal["text"]
    text: str

    @field_validator("text")
    @classmethod
    def _text_is_unicode(cls, text: str) -> str:
        return _unicode(text)


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(None, description="passed to the chat template (most ignore it)")
    tool_calls: list[dict] = Field(default_factory=list)
    tool_call_id: str | None = None

    @field_validator("role")
    @classmethod
    def _no_tool_messages(cls, role: str) -> str:
        # function calling is not supported: the template would render a result to no call
        return _reject_if(role, role == "tool", "a tool message (function calling)")

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content):
        """Image, audio and file parts are a 400 naming their type: dropped, the model would
        answer about a picture it never saw."""
        if isinstance(content, list):
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                _reject_if(part, kind not in ("text", None),
                           f"a content part of type {kind!r} (only text)")
        return content

    @field_validator("content", "name")
    @classmethod
    def _is_unicode(cls, text):
        return _unicode(text) if isinstance(text, str) else text

    @field_validator("tool_calls", mode="before")
    @classmethod
    def _no_tool_calls(cls, v):
        # Dropped, the model would see an empty assistant turn where the client's history has a
        # call; the chat template renders none of it.
        return _reject_if(v, bool(v), "an assistant message with tool_calls (function calling)")

    @model_validator(mode="after")
    def _content_unless_assistant(self):
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self

    def text(self) -> str:
        """The content as one string: text parts joined by newlines (as vLLM joins them)."""
        if isinstance(self.content, list):
            return "\n".join(p.text for p in self.content)
        return self.content or ""

    def for_template(self) -> dict:
        """The message as the chat template gets it (``developer`` is the ``system`` role)."""
        message = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        return message if self.name is None else {**message, "name": self.name}


class ChatCompletionRequest(_Request):
    UNSUPPORTED: ClassVar[dict[str, object]] = {
        **_Request.UNSUPPORTED, "logprobs": False, "top_logprobs": 0, "echo": False,
        "add_generation_prompt": True, "continue_final_message": False, "add_special_tokens": False,
        **dict.fromkeys(("chat_template", "chat_template_kwargs", "documents"), _OFF),
    }

    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1, description="alias of max_tokens")
    tools: list[dict] = Field(default_factory=list)
    functions: list[dict] = Field(default_factory=list)
    tool_choice: str | dict = "none"
    function_call: str | dict = "none"
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

    @field_validator("messages")
    @classmethod
    def _non_empty(cls, messages):
        if not messages:
            raise ValueError("messages must contain at least one message")
        return messages

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
