"""SGLang plugin (entry point group ``sglang.srt.plugins``): capture verify steps for traces.

``load_plugins()`` calls ``register`` in every SGLang process, the spawned schedulers included.
It registers an AROUND hook on ``eagle_sample`` (contract.HOOK_TARGET), which every EAGLE3 and
STANDALONE verify step calls. Per step the hook

  1. picks the sampled requests (by request-id hash, so a request is captured whole or not at all),
  2. takes the target top-k of every tree node *before* calling the original (eagle_sample adds
     penalties and grammar masks to the logits in place; the trace wants the model's distribution),
  3. calls the original and returns its result untouched,
  4. reduces on the device to one packed tensor and makes one asynchronous host copy,
  5. hands it to the per-process exporter, which ships it to the engine process.

Any failure in 1/2/4/5 disables capture in that process (logged once); serving goes on.
"""

from __future__ import annotations

import logging
import zlib
from dataclasses import dataclass

import torch

from serving.sglang.contract import HOOK_TARGET
from serving.sglang.exporter import ExportConfig, StepExporter
from serving.sglang.reduction import (
    StepLayout,
    from_sglang,
    reduce_verify_step,
    summarize_target,
)

log = logging.getLogger(__name__)


def register() -> None:
    """Entry point. Registers nothing unless SGLangEngine configured a trace channel."""
    if ExportConfig.from_env() is None:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(HOOK_TARGET, around_eagle_sample, HookType.AROUND)


def around_eagle_sample(original, *args, **kwargs):
    return _process_capture().around(original, args, kwargs)


def request_sampled(rid: str, rate: float) -> bool:
    """Stable per request (and across processes): a request's steps are all kept or all dropped."""
    if rate >= 1.0:
        return True
    return zlib.crc32(rid.encode()) < rate * 2**32


@dataclass
class _Pending:
    verify_input: object
    batch_size: int
    rows: torch.Tensor | None  # [R] int64 sampled requests, None = all
    request_ids: list[str]
    prompt_lens: list[int]
    topk_ids: torch.Tensor  # [R, N, T] int32
    topk_logprobs: torch.Tensor  # [R, N, T] float32


class TraceCapture:
    def __init__(self, exporter: StepExporter | None, sample_rate: float = 1.0, top_k: int = 20):
        self.exporter = exporter
        self.sample_rate = sample_rate
        self.top_k = top_k
        self.enabled = exporter is not None
        self.steps = 0

    def around(self, original, args: tuple, kwargs: dict):
        pending = self._guard(self._before, args, kwargs) if self.enabled else None
        result = original(*args, **kwargs)
        if pending is not None:
            self._guard(self._after, pending, result)
        return result

    def _guard(self, fn, *args):
        try:
            return fn(*args)
        except Exception:
            self.enabled = False
            log.exception("specloop trace capture failed; disabled in this process")
            return None

    def _before(self, args: tuple, kwargs: dict) -> _Pending | None:
        verify_input, batch, logits_output = _bind(args, kwargs)
        if batch.forward_mode.is_idle():
            return None
        reqs = batch.reqs
        keep = [i for i, req in enumerate(reqs) if request_sampled(req.rid, self.sample_rate)]
        if not keep:
            return None
        b, n = len(reqs), int(verify_input.draft_token_num)
        logits = logits_output.next_token_logits[: b * n].reshape(b, n, -1)  # [B, N, V]
        rows = None
        if len(keep) < b:
            rows = torch.tensor(keep, dtype=torch.int64).to(logits.device, non_blocking=True)
            logits = logits.index_select(0, rows)  # [R, N, V]
        topk_ids, topk_logprobs = summarize_target(logits, self.top_k)  # [R, N, T] each
        return _Pending(
            verify_input=verify_input,
            batch_size=b,
            rows=rows,
            request_ids=[reqs[i].rid for i in keep],
            prompt_lens=[len(reqs[i].origin_input_ids) for i in keep],
            topk_ids=topk_ids,
            topk_logprobs=topk_logprobs,
        )

    def _after(self, pending: _Pending, result) -> None:
        predict, accept_lens, accept_index = result
        if int(accept_lens.shape[0]) != pending.batch_size:
            return  # padded batch (e.g. DP attention): rows do not map to requests
        step = from_sglang(pending.verify_input, predict, accept_lens, accept_index)
        if pending.rows is not None:
            step = step.select(pending.rows)
        packed = reduce_verify_step(step, pending.topk_ids, pending.topk_logprobs)  # [R, W]
        layout = StepLayout(depth=step.depth, top_k=self.top_k)
        self.exporter.submit(packed, layout, pending.request_ids, pending.prompt_lens)
        self.steps += 1


def _bind(args: tuple, kwargs: dict):
    """eagle_sample(verify_input, batch, logits_output, ...): positional or by keyword."""
    names = ("verify_input", "batch", "logits_output")
    return tuple(args[i] if i < len(args) else kwargs[name] for i, name in enumerate(names))


_capture: TraceCapture | None = None


def _process_capture() -> TraceCapture:
    """One capture (and exporter thread) per process, created on the first verify step."""
    global _capture
    if _capture is None:
        config = ExportConfig.from_env()
        exporter = StepExporter(config) if config and _is_first_attention_rank() else None
        _capture = TraceCapture(exporter, config.sample_rate if config else 0.0,
                                config.top_k if config else 20)
    return _capture


def _is_first_attention_rank() -> bool:
    """Tensor-parallel ranks verify the same batch: export it once."""
    try:
        from sglang.srt.runtime_context import get_parallel

        return int(get_parallel().attn_tp_rank) == 0
    except Exception:  # noqa: BLE001  (no parallel context published: single process)
        return True
