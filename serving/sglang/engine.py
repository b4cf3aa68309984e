"""SGLangEngine: the Engine protocol (serving/engine/base.py) on ``sglang.Engine`` 0.5.23.

SGLang runs the model and the speculative loop (EAGLE3 or STANDALONE); everything else is shared
with TorchEngine:
  - observers (serving/observers.py: trace recorder, metrics, live acceptance) get the same events:
    ``on_request_start``/``on_request_finish`` from here, ``on_step`` from the VerifyBatch events the
    plugin captures in SGLang's scheduler processes (received by a TraceCollector);
  - stop tokens, EOS and stop strings go through ``serving.output.apply_stops`` like TorchEngine's
    steps: SGLang gets the stop token ids (it stops on them itself), not the stop strings; when the
    shared rule ends a request that SGLang would continue, the engine aborts it in SGLang;
  - drafter swaps come from the shared Swapper through ``swap_drafter`` (draft-only weight session,
    draft_weights.py; drafters are SGLangDraft, drafts.py);
  - requests are checked by ``serving.engine.request_checks.check_request`` (RequestError,
    invalid) before they are admitted or reach SGLang;
  - admission control is the AdmissionGate TorchEngine uses too (serving/engine/admission.py):
    requests in flight, running or queued inside SGLang, are at most SGLang's
    ``max_running_requests`` + ``max_waiting``; one more gets Overloaded (HTTP 429).

SGLang samples a request's first output token in the prefill, not in a verify step, so the verify
steps cover ``output[1:]``. Observers therefore see each request with that first token appended to
its prompt (``on_request_finish`` gets ``output_ids[1:]``), which keeps every trace exact: each
traced output token comes from a verify step with the target's top-k.

sglang is imported inside methods only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
import time
from collections.abc import AsyncIterator
from contextlib import contextmanager
from pathlib import Path

from feedback.bus.trace import DrafterKind
from feedback.target.fingerprint import TargetFingerprint
from serving.engine.admission import AdmissionGate
from serving.engine.base import (
    GenerationChunk,
    GenerationRequest,
    RequestError,
    SpecStats,
    Unavailable,
)
from serving.engine.request_checks import check_request
from serving.observers import notify
from serving.output import OutputText, apply_stops, eos_token_ids, stop_token_set
from serving.sglang.collector import InstallLog, TraceCollector, to_verify_batch
from serving.sglang.config import SGLangConfig
from serving.sglang.draft_weights import update_draft_weights, verify_draft_only_update
from serving.sglang.drafts import SGLangDraft
from serving.sglang.exporter import ENV_SAMPLE_RATE, ENV_TOP_K
from serving.sglang.meta_info import finish_reason, refused, sglang_sampling_params, spec_stats
from serving.sglang.plugin import request_sampled

SELF_TEST_PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
TRACE_WAIT_S = 5.0
"""How long a finished request waits for its last verify steps (they arrive over a separate
channel) before observers are told it finished; late steps would be missing from its trace."""
ABORT_DRAIN_S = 1.0
"""After aborting a request the shared stop rules ended, how long to wait for SGLang's final
output (it carries the request's speculative stats)."""

log = logging.getLogger(__name__)


class SGLangEngine:
    def __init__(self, config: SGLangConfig, observers: list | tuple = (), tokenizer=None,
                 fingerprint: TargetFingerprint | None = None):
        self.config = config
        self.model_name = config.model_id or Path(config.model_path).name
        self.tokenizer = tokenizer
        self.fingerprint = fingerprint
        self.max_context = 0
        self.eos_ids: frozenset[int] = frozenset()
        self.observers = list(observers)
        self._drafter = SGLangDraft(kind=config.drafter_kind, version=config.drafter_version,
                                    path=Path(config.draft_path))
        self._installed = InstallLog(self._drafter.version)
        self._source = DrafterKind.EAGLE if config.algorithm == "EAGLE3" else DrafterKind.STANDALONE
        self._engine = None
        self._collector: TraceCollector | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._swap_lock = asyncio.Lock()
        self._metadata_loaded = False
        self._covered: dict[str, int] = {}
        """Traced request id -> output tokens its verify steps received so far cover."""
        self._covered_lock = threading.Lock()
        self._finishing: set[asyncio.Task] = set()
        self.admission = AdmissionGate(config.max_running, config.max_waiting)

    # ---- Engine protocol ---------------------------------------------------------------------

    async def start(self) -> None:
        from serving.sglang.source_check import require_sglang

        require_sglang()  # names any missing hook point before a GPU is touched
        self._loop = asyncio.get_running_loop()
        self.load_metadata()
        if self.observers:  # verify steps feed traces, metrics and live acceptance
            self._collector = TraceCollector(self._on_step)
        from sglang.srt.entrypoints.engine import Engine

        with self._trace_env():  # inherited by the spawned scheduler processes
            self._engine = Engine(**self.config.sglang_kwargs())
        self._bound_admission()
        if self.config.self_test:
            try:
                await verify_draft_only_update(self._engine, self.config.draft_path,
                                               SELF_TEST_PROMPT)
            except Exception:
                await self.stop()
                raise
        notify(self.observers, "on_drafter_change", self._drafter.kind, self._drafter.version)

    async def stop(self) -> None:
        if self._finishing:
            await asyncio.gather(*list(self._finishing), return_exceptions=True)
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None
        if self._collector is not None:
            self._collector.close()
            self._collector = None

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        fp = self.fingerprint  # vocab_size and max_context: load_metadata's (None/0: unknown yet)
        check_request(request, vocab_size=fp.vocab_size if fp is not None else None,
                      max_context=self.max_context or None)  # before admission: nothing to release
        if self._engine is None:
            raise Unavailable("the SGLang engine is not running")
        p = request.params
        text = OutputText(self.tokenizer, request.prompt_ids, p.stop,
                          skip_special_tokens=p.skip_special_tokens)
        stop_ids = stop_token_set(p.stop_token_ids, self.eos_ids, p.ignore_eos)
        self.admission.admit(request.request_id)  # Overloaded beyond the bound; _close releases
        try:
            observed = self._open(request)
        except BaseException:
            self.admission.release(request.request_id)
            raise
        kept: list[int] = []
        stats = SpecStats()
        reason = None
        try:
            stream = await self._engine.async_generate(
                input_ids=request.prompt_ids, sampling_params=sglang_sampling_params(p),
                stream=True, rid=request.request_id)
            seen = 0
            async for out in stream:
                ids, meta = out["output_ids"], out["meta_info"]
                error = refused(meta)
                if error is not None:
                    raise error
                new = [int(t) for t in ids[seen:]]  # ids may grow in place: read it before awaiting
                seen += len(new)
                step = apply_stops(text, stop_ids, new)
                kept.extend(step.tokens)
                done = finish_reason(meta)
                if done is not None:
                    stats = spec_stats(meta)
                if step.stopped:
                    reason = "stop"
                    if done is None:  # a stop string (or an EOS id SGLang does not know) ended it
                        stats = await self._abort_and_drain(request.request_id, stream, stats)
                else:
                    reason = done
                if reason is None:
                    yield self._chunk(request, step.tokens, step.text, None, kept, stats)
                    continue
                final_text = step.text + ("" if step.stopped else text.flush())
                self._close(observed, kept, reason, stats)  # before the last yield: the consumer
                yield self._chunk(request, step.tokens, final_text, reason, kept, stats)  # stops
                return
            reason = "abort"  # the stream ended without a finish reason
            self._close(observed, kept, reason, stats)
            yield self._chunk(request, [], text.flush(), reason, kept, stats)
        except Exception as exc:
            reason = "error"
            self._close(observed, kept, reason, stats)
            if isinstance(exc, RequestError):
                raise
            raise RequestError(f"SGLang failed: {exc}", invalid=isinstance(exc, ValueError)) from exc
        finally:
            if reason is None:  # the consumer went away (client disconnect, cancellation)
                self._close(observed, kept, "abort", stats)

    async def abort(self, request_id: str) -> None:
        if self._engine is not None:
            self._engine.tokenizer_manager.abort_request(rid=request_id)

    def load(self) -> tuple[int, int]:
        """(waiting, running) from the admission bound's count: without it every heartbeat of an
        SGLang replica read idle, and the trainer never yielded to a saturated one."""
        return self.admission.load()

    @property
    def drafter(self) -> SGLangDraft:
        return self._drafter

    def swap_drafter(self, drafter: SGLangDraft) -> None:
        """Install ``drafter`` from a thread other than the engine's event loop (the Swapper's, an
        admin worker); blocks until the weights are in. On the loop: ``await install_draft``."""
        if self._loop is None or self._engine is None:
            raise RuntimeError("SGLangEngine is not started")
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            raise RuntimeError("swap_drafter would block the engine's event loop: await "
                               "install_draft instead")
        tensors = drafter.named_tensors()  # disk reads stay off the event loop
        asyncio.run_coroutine_threadsafe(self.install_draft(drafter, tensors), self._loop).result()

    async def install_draft(self, drafter: SGLangDraft, tensors=None) -> None:
        """Draft-only hot swap: in-flight requests keep going with the new draft."""
        if tensors is None:
            tensors = await asyncio.to_thread(drafter.named_tensors)
        async with self._swap_lock:
            await update_draft_weights(self._engine, tensors)
            self._drafter = drafter
            self._installed.add(time.monotonic(), drafter.version)
        notify(self.observers, "on_drafter_change", drafter.kind, drafter.version)

    def load_metadata(self) -> None:
        """Tokenizer, fingerprint, context length and EOS ids from the model directory (CPU only,
        no sglang): the HTTP layer and the trace recorder need them before the engine starts."""
        if self._metadata_loaded:
            return
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig

        from feedback.target.fingerprint import fingerprint_for

        path = self.config.model_path
        hf_config = AutoConfig.from_pretrained(path)
        if self.tokenizer is None:
            self.tokenizer = AutoTokenizer.from_pretrained(path)
        try:
            generation = GenerationConfig.from_pretrained(path)
        except OSError:  # no generation_config.json
            generation = None
        if self.fingerprint is None:
            self.fingerprint = fingerprint_for(self.model_name, self.tokenizer,
                                               int(hf_config.vocab_size))
        self.max_context = int(getattr(hf_config, "max_position_embeddings", 0) or 0)
        self.eos_ids = eos_token_ids(generation, hf_config, self.tokenizer)
        self._metadata_loaded = True

    # ---- observers -------------------------------------------------------------------------

    def _open(self, request: GenerationRequest) -> GenerationRequest:
        """The request as observers see it (see the module docstring): a copy whose prompt gets
        the first output token appended at finish. Requests the plugin does not sample are
        observed with ``train=False`` (no trace)."""
        sampled = self._collector is not None and request_sampled(
            request.request_id, self.config.trace_sample_rate)
        observed = dataclasses.replace(request, prompt_ids=list(request.prompt_ids),
                                       train=request.train and sampled)
        if observed.train:
            with self._covered_lock:
                self._covered[request.request_id] = 0
        notify(self.observers, "on_request_start", observed)
        return observed

    def _close(self, observed: GenerationRequest, kept: list[int], reason: str,
               stats: SpecStats) -> None:
        self.admission.release(observed.request_id)  # before the last chunk reaches the client
        if kept:
            observed.prompt_ids.append(kept[0])  # sampled in the prefill, not by a verify step
        output = kept[1:]
        with self._covered_lock:
            waiting = observed.request_id in self._covered
        if waiting and self._loop is not None and self._loop.is_running():
            task = self._loop.create_task(self._finish_when_covered(observed, output, reason, stats))
            self._finishing.add(task)
            task.add_done_callback(self._finishing.discard)
        else:
            self._finish(observed, output, reason, stats)

    async def _finish_when_covered(self, observed, output, reason, stats) -> None:
        deadline = time.monotonic() + TRACE_WAIT_S
        while time.monotonic() < deadline:
            with self._covered_lock:
                covered = self._covered.get(observed.request_id, 0)
            if covered >= len(output):
                break
            await asyncio.sleep(0.005)
        self._finish(observed, output, reason, stats)

    def _finish(self, observed, output, reason, stats) -> None:
        with self._covered_lock:
            self._covered.pop(observed.request_id, None)
        notify(self.observers, "on_request_finish", observed, output, reason, stats)

    def _on_step(self, message) -> None:
        """Collector thread: one verify step of SGLang's batch."""
        batch = to_verify_batch(message, self._source, self._installed.version_at(message.hooked_at))
        notify(self.observers, "on_step", batch)
        with self._covered_lock:  # after the observers saw it: a finish may follow right away
            for rid, accepted in zip(batch.request_ids, batch.num_accepted.tolist()):
                if rid in self._covered:
                    self._covered[rid] += int(accepted) + 1

    # ---- internals -------------------------------------------------------------------------

    def _bound_admission(self) -> None:
        """Without a configured running-batch size, the admission bound uses the one SGLang
        resolved (its server_args after launch); none known: unbounded, and said so."""
        gate = self.admission
        if gate.max_running is None:
            resolved = getattr(self._engine.server_args, "max_running_requests", None)
            gate.max_running = int(resolved) if resolved else None
        if gate.limit is None and gate.max_waiting is not None:
            log.warning("max_waiting=%d is not enforced: SGLang's running-batch size is unknown "
                        "(set SPECLOOP_MAX_BATCH_SIZE, its max_running_requests)", gate.max_waiting)

    def _chunk(self, request: GenerationRequest, tokens: list[int], text: str,
               reason: str | None, kept: list[int], stats: SpecStats) -> GenerationChunk:
        return GenerationChunk(
            request_id=request.request_id,
            token_ids=list(tokens),
            text=text,
            finished=reason is not None,
            finish_reason=reason,
            prompt_tokens=len(request.prompt_ids),
            completion_tokens=len(kept),
            stats=stats,
        )

    async def _abort_and_drain(self, request_id: str, stream, stats: SpecStats) -> SpecStats:
        """Abort a request in SGLang and wait (briefly) for its final output, for its stats."""
        self._engine.tokenizer_manager.abort_request(rid=request_id)
        try:
            async with asyncio.timeout(ABORT_DRAIN_S):
                async for out in stream:
                    if finish_reason(out["meta_info"]) is not None:
                        return spec_stats(out["meta_info"])
        except Exception as exc:  # noqa: BLE001  (timeout, an abort raised as an error)
            log.debug("no final output for aborted %s (%s): stats unknown", request_id, exc)
        return stats

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
