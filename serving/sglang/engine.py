"""SGLangEngine: the Engine protocol (serving/engine/base.py) on ``sglang.Engine`` 0.5.23.

SGLang runs the model and the speculative loop (EAGLE3 or STANDALONE); everything else is shared
with TorchEngine: verify steps come back as VerifyBatch events (captured by the plugin in the
scheduler processes, received by a TraceCollector here) for the same observers, and drafter swaps
go through ``load_draft`` (draft-only weight session). sglang is imported inside methods only.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from feedback.fingerprint import TargetFingerprint, tokenizer_hash
from feedback.trace import DrafterKind
from serving.drafters.base import DrafterInfo
from serving.engine.base import (
    GenerationChunk,
    GenerationRequest,
    SamplingParams,
    SpecStats,
    VerifyBatch,
)
from serving.sglang.collector import TraceCollector, to_verify_batch
from serving.sglang.draft_weights import (
    read_draft_tensors,
    update_draft_weights,
    verify_draft_only_update,
)
from serving.sglang.exporter import ENV_SAMPLE_RATE, ENV_TOP_K

SELF_TEST_PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]


@dataclass
class SGLangConfig:
    model_path: str
    draft_path: str
    """EAGLE3: our eagle head exported to SGLang's EAGLE3 layout; STANDALONE: a small LM dir."""
    algorithm: Literal["EAGLE3", "STANDALONE"] = "STANDALONE"
    num_steps: int = 4
    """Draft depth per verify step (k)."""
    eagle_topk: int = 1
    """Branching per draft step; 1 = a chain, which the trace records exactly."""
    num_draft_tokens: int | None = None
    """Verified tree nodes including the root; default num_steps + 1 (the chain)."""
    drafter_version: str = "day0"
    trace_sample_rate: float = 1.0
    trace_top_k: int = 20
    self_test: bool = True
    """At start: check that a draft update changes the draft and not the target."""
    server_args: dict = field(default_factory=dict)
    """Further sglang ServerArgs, e.g. mem_fraction_static, tp_size, dtype."""

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


def sglang_sampling_params(p: SamplingParams) -> dict:
    """Stop strings are not sent: the shared output layer applies them (and aborts)."""
    params = {"max_new_tokens": p.max_tokens, "temperature": p.temperature, "top_p": p.top_p,
              "ignore_eos": p.ignore_eos}
    if p.top_k:
        params["top_k"] = p.top_k
    if p.stop_token_ids:
        params["stop_token_ids"] = list(p.stop_token_ids)
    if p.seed is not None:
        params["sampling_seed"] = p.seed
    return params


def spec_stats(meta_info: dict) -> SpecStats:
    """Per-request speculative stats (SGLang reports them on the finished output)."""
    return SpecStats(
        verify_steps=int(meta_info.get("spec_verify_ct", 0)),
        drafted_tokens=int(meta_info.get("spec_num_proposed_drafts", 0)),
        accepted_tokens=int(meta_info.get("spec_num_correct_drafts", 0)),
    )


def finish_reason(meta_info: dict) -> str | None:
    reason = meta_info.get("finish_reason")
    if reason is None:
        return None
    kind = reason.get("type") if isinstance(reason, dict) else str(reason)
    return kind if kind in ("stop", "length", "abort") else "stop"


class SGLangEngine:
    def __init__(self, config: SGLangConfig, on_verify: Callable[[VerifyBatch], None] | None = None,
                 tokenizer=None, fingerprint: TargetFingerprint | None = None):
        self.config = config
        self.model_name = Path(config.model_path).name
        self.tokenizer = tokenizer
        self.fingerprint = fingerprint
        self.max_context = 0
        self._on_verify = on_verify
        self._info = DrafterInfo(kind=config.algorithm.lower(), version=config.drafter_version)
        self._source = DrafterKind.EAGLE if config.algorithm == "EAGLE3" else DrafterKind.STANDALONE
        self._engine = None
        self._collector: TraceCollector | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._swap_lock = asyncio.Lock()

    async def start(self) -> None:
        from serving.sglang.source_check import require_sglang

        require_sglang()  # names any missing hook point before a GPU is touched
        self._loop = asyncio.get_running_loop()
        self._load_target_metadata()
        if self._on_verify is not None:
            self._collector = TraceCollector(self._on_step)
        from sglang.srt.entrypoints.engine import Engine

        with self._trace_env():  # inherited by the spawned scheduler processes
            self._engine = Engine(**self.config.sglang_kwargs())
        if self.config.self_test:
            try:
                await verify_draft_only_update(self._engine, self.config.draft_path,
                                               SELF_TEST_PROMPT)
            except Exception:
                await self.stop()
                raise

    async def stop(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None
        if self._collector is not None:
            self._collector.close()
            self._collector = None

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        stream = await self._engine.async_generate(
            input_ids=request.prompt_ids, sampling_params=sglang_sampling_params(request.params),
            stream=True, rid=request.request_id)
        sent = 0
        async for out in stream:
            ids, meta = out["output_ids"], out["meta_info"]
            reason = finish_reason(meta)
            yield GenerationChunk(
                request_id=request.request_id,
                token_ids=list(ids[sent:]),
                text="",  # detokenisation is the shared output layer's
                finished=reason is not None,
                finish_reason=reason,
                prompt_tokens=int(meta.get("prompt_tokens", len(request.prompt_ids))),
                completion_tokens=int(meta.get("completion_tokens", len(ids))),
                stats=spec_stats(meta),
            )
            sent = len(ids)

    async def abort(self, request_id: str) -> None:
        self._engine.tokenizer_manager.abort_request(rid=request_id)

    @property
    def drafter(self) -> DrafterInfo:
        return self._info

    def swap_drafter(self, drafter) -> None:
        """Install ``drafter`` (``.path``: SGLang-layout directory, ``.version``) from a thread other
        than the engine's event loop; blocks until the weights are in. In the loop: ``load_draft``."""
        if self._loop is None:
            raise RuntimeError("SGLangEngine is not started")
        future = asyncio.run_coroutine_threadsafe(
            self.load_draft(drafter.path, drafter.version), self._loop)
        future.result()

    async def load_draft(self, path: str | Path, version: str) -> None:
        """Draft-only hot swap: in-flight requests keep going with the new draft."""
        tensors = read_draft_tensors(path)
        async with self._swap_lock:
            await update_draft_weights(self._engine, tensors)
            self._info = DrafterInfo(kind=self._info.kind, version=version)

    def _on_step(self, message) -> None:
        batch = to_verify_batch(message, self._source, self._info.version)
        self._on_verify(batch)

    def _load_target_metadata(self) -> None:
        from transformers import AutoConfig, AutoTokenizer

        hf_config = AutoConfig.from_pretrained(self.config.model_path)
        if self.tokenizer is None:
            self.tokenizer = AutoTokenizer.from_pretrained(self.config.model_path)
        if self.fingerprint is None:
            self.fingerprint = TargetFingerprint(
                model_id=self.model_name, tokenizer_hash=tokenizer_hash(self.tokenizer),
                vocab_size=hf_config.vocab_size)
        self.max_context = int(getattr(hf_config, "max_position_embeddings", 0) or 0)

    @contextmanager
    def _trace_env(self):
        env = {}
        if self._collector is not None:
            env = {**self._collector.env(), ENV_SAMPLE_RATE: str(self.config.trace_sample_rate),
                   ENV_TOP_K: str(self.config.trace_top_k)}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
