"""SGLangConfig: what SGLangEngine starts ``sglang.Engine`` with (model, draft, speculative steps)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from feedback.registry.artifact_keys import DAY0_VERSION

ALGORITHM_KIND = {"EAGLE3": "eagle", "STANDALONE": "standalone"}


@dataclass
class SGLangConfig:
    model_path: str
    draft_path: str
    """EAGLE3: our eagle head exported to SGLang's EAGLE3 layout; STANDALONE: a small LM dir."""
    model_id: str | None = None
    """Target name in fingerprints and /v1/models; default: the model directory's name."""
    algorithm: Literal["EAGLE3", "STANDALONE"] = "STANDALONE"
    num_steps: int = 4
    """Draft depth per verify step (k)."""
    eagle_topk: int = 1
    """Branching per draft step; 1 = a chain, which the trace records exactly."""
    num_draft_tokens: int | None = None
    """Verified tree nodes including the root; default num_steps + 1 (the chain)."""
    drafter_version: str = DAY0_VERSION
    trace_sample_rate: float = 1.0
    trace_top_k: int = 20
    self_test: bool = True
    """At start: check that a draft update changes the draft and not the target."""
    server_args: dict = field(default_factory=dict)
    """Further sglang ServerArgs, e.g. mem_fraction_static, tp_size, dtype."""
    max_waiting: int | None = None
    """Admission bound (serving/engine/admission.py): SGLang queues requests in its own scheduler,
    out of our sight, so the bound counts requests in flight (admitted by ``generate`` and not
    finished: running or queued in SGLang) and refuses one more (HTTP 429) beyond
    ``max_running + max_waiting``. None = unbounded."""

    @property
    def max_running(self) -> int | None:
        """SGLang's running-batch size when configured (``max_running_requests``), else None
        (SGLang chooses; the engine reads its choice at start)."""
        value = self.server_args.get("max_running_requests")
        return int(value) if value is not None else None

    @property
    def drafter_kind(self) -> str:
        """Our drafter kind for the algorithm: eagle (EAGLE3) or standalone (STANDALONE)."""
        return ALGORITHM_KIND[self.algorithm]

    def sglang_kwargs(self) -> dict:
        return {
            "model_path": self.model_path,
            "speculative_algorithm": self.algorithm,
            "speculative_draft_model_path": self.draft_path,
            "speculative_num_steps": self.num_steps,
            "speculative_eagle_topk": self.eagle_topk,
            "speculative_num_draft_tokens": self.num_draft_tokens or self.num_steps + 1,
            "incremental_streaming_output": False,  # output_ids are cumulative
            **self.server_args,
        }
