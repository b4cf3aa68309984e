"""TorchEngine: speculative decoding of a Hugging Face causal LM with continuous batching.

One background thread runs the step loop (torch releases the GIL in its kernels); ``generate``
is an async iterator fed from that thread through the caller's event loop. Each step:

    admit   waiting requests join (prefill prompt[:-1] alone, append the row to the batch cache)
    draft   the drafter proposes up to k tokens per row (k from the SpeculationPolicy), a chain or
            a token tree (point-mass drafts); a tree-aware policy may cut it to fewer nodes
    verify  ONE target forward over [last token + drafts] for every row (ragged, see batch_cache;
            trees get depth positions and an ancestor mask)
    accept  a walk from the root following the target's token (kernels/tree_verify.py): argmax
            (temperature 0) or a position-keyed sample (sampled rows, point-mass drafts; see
            seeded.py); rejection sampling for chains of drafts with dists
    commit  each row keeps its accepted path + 1 KV columns (moved together for trees), streams
            its tokens, may finish
    report  one VerifyBatch to the observers; drafter.on_verified per row

The last prompt token is not prefilled: it is the first input of the first verify step, so every
output token comes out of a verify step (and the drafter may already draft the first tokens).

Failures stay local: a bad request is refused by ``generate`` (RequestError, invalid=True); a
drafter that raises loses its drafts (requests continue, still lossless); a failing prefill ends
that request; a failing batch forward ends the requests of that batch with an error and the loop
carries on with a fresh cache.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import AsyncIterator

import numpy as np
import torch

from kernels.threads import serial_torch
from kernels.tree_verify import tree_ancestors, tree_depths
from serving.drafters.base import Drafter
from serving.engine.admission import AdmissionGate
from serving.engine.base import (
    GenerationChunk,
    GenerationRequest,
    RequestError,
    Unavailable,
    VerifyBatch,
)
from serving.engine.config import EngineConfig
from serving.engine.drafter_swap import DrafterSwaps
from serving.engine.drafting import DraftPlan, plan_from_proposal
from serving.engine.membership import RowMembership
from serving.engine.model_runner import ModelRunner
from serving.engine.outbox import Outbox
from serving.engine.policy import BatchState, FixedK, SpeculationPolicy
from serving.engine.request_checks import check_request
from serving.engine.rows import Client, Row, Submission
from serving.engine.tree import trim_plan
from serving.engine.verify_step import path_features, step_report, verify_rows
from serving.observers import notify
from serving.output import eos_token_ids
from serving.target import Target

log = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class TorchEngine(DrafterSwaps, RowMembership):
    """The embedded engine. Its rooms: this file runs the step loop; serving/engine/membership.py
    moves requests (checked by request_checks.py, as SGLangEngine's) into and out of the batch's rows;
    serving/engine/model_runner.py calls the target (forward, caches, features);
    serving/engine/verify_step.py accepts drafts and builds the observers' report;
    serving/engine/drafter_swap.py installs new drafters under a running batch."""

    def __init__(
        self,
        target: Target,
        drafter: Drafter | None = None,
        config: EngineConfig | None = None,
        observers: list | tuple = (),
        policy: SpeculationPolicy | None = None,
    ):
        self.config = config or EngineConfig()
        cfg = self.config
        if cfg.device is not None or cfg.dtype is not None:
            target.model.to(device=cfg.device, dtype=_DTYPES[cfg.dtype] if cfg.dtype else None)
        self.target = target
        self.model = target.model.eval()
        self.tokenizer = target.tokenizer
        self.model_name = target.model_id
        self.fingerprint = target.fingerprint
        self.max_context = min(cfg.max_context or target.max_context, target.max_context)
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self.device = target.device
        self.runner = ModelRunner(self.model, self.device, cfg.forward, cfg.native_kernels,
                                  cfg.bf16_panels, cfg.amx_panels, cfg.cuda_graphs,
                                  prefix_cache_tokens=cfg.prefix_cache_tokens,
                                  bf16_activations=cfg.bf16_activations)
        self.eos_ids = _eos_ids(target)
        self.observers = list(observers)
        self.policy: SpeculationPolicy = policy or FixedK(cfg.k)
        self._init_swaps(drafter)  # drafter_swap.py: the live drafter and pending swaps

        self._cv = threading.Condition()
        self._inbox: list[Submission] = []
        self._abort_ids: set[str] = set()
        self.admission = AdmissionGate(cfg.max_batch_size, cfg.max_waiting, cfg.retry_after_s)
        """Requests in flight (running or waiting for a row), bounded (HTTP 429 beyond)."""
        self._stopping = False
        self._thread: threading.Thread | None = None

        # Owned by the step thread.
        self._waiting: collections.deque[Submission] = collections.deque()
        self._rows: list[Row] = []
        self._outbox = Outbox()
        """Replies to clients, held for the next forward's native stretch (outbox.py)."""
        self._cache = self._new_cache()
        self.steps = 0
        self.drafter_errors = 0

    # ---- Engine protocol ---------------------------------------------------------------------

    @property
    def drafter(self) -> Drafter | None:
        return self._drafter

    async def start(self) -> None:
        self._start_thread()

    async def stop(self) -> None:
        thread = self._thread
        if thread is None:
            return
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        await asyncio.to_thread(thread.join)
        self._preparer.stop()

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        check_request(request, vocab_size=self.vocab_size, max_context=self.max_context)
        self._start_thread()
        client = Client(asyncio.get_running_loop(), asyncio.Queue())
        with self._cv:
            if self._stopping:
                raise Unavailable("the engine is stopping")
            self.admission.admit(request.request_id)
            self._inbox.append(Submission(request, client))
            self._cv.notify_all()
        finished = False
        try:
            while True:
                item = await client.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:  # the caller stopped listening: free the row
                self._request_abort(request.request_id)

    def load(self) -> tuple[int, int]:
        """(requests waiting for a row, requests running): what the load heartbeat reports."""
        with self._cv:
            return len(self._inbox) + len(self._waiting), len(self._rows)

    async def abort(self, request_id: str) -> None:
        self._request_abort(request_id)

    # ---- thread plumbing ---------------------------------------------------------------------

    def _start_thread(self) -> None:
        with self._cv:
            if self._thread is not None:
                return
            if self.config.num_threads:
                torch.set_num_threads(self.config.num_threads)
            self._announce_drafter()
            width = torch.get_num_threads() if self.config.serial_step_ops else None
            self._thread = threading.Thread(target=self._run, args=(width,), name="specloop-engine",
                                            daemon=True)
            self._thread.start()

    def _request_abort(self, request_id: str) -> None:
        with self._cv:
            if request_id in self.admission:
                self._abort_ids.add(request_id)
                self._cv.notify_all()

    def _run(self, kernel_width: int | None) -> None:
        if kernel_width is not None:
            serial_torch(kernel_width)
        with torch.inference_mode():
            while True:
                with self._cv:
                    while not (
                        self._stopping
                        or self._inbox
                        or self._abort_ids
                        or self._rows
                        or self._waiting
                        or self._pending_swap is not None
                        or self._snapshot_wanted
                    ):
                        self._cv.wait(self.config.idle_poll_s)
                    if self._stopping:
                        break
                    self._waiting.extend(self._inbox)
                    self._inbox.clear()
                    aborts, self._abort_ids = self._abort_ids, set()
                    wanted, self._snapshot_wanted = self._snapshot_wanted, []
                    slow = self._pending_swap is not None or bool(wanted)
                if slow:  # a swap or a snapshot comes first: no stretch to hold them for
                    self._outbox.flush()
                try:
                    self._apply_swap()
                    self._apply_aborts(aborts)
                    self._admit()
                    self._serve_snapshots(wanted)
                    if self._rows:
                        self._step_or_fail()
                except Exception:  # never let the loop die
                    log.exception("engine loop error")
                if not self._rows:
                    self._outbox.flush()  # no forward comes next
            self._shutdown()

    def _shutdown(self) -> None:
        with self._cv:
            self._waiting.extend(self._inbox)
            self._inbox.clear()
            wanted, self._snapshot_wanted = self._snapshot_wanted, []
        for req in wanted:  # a swap being prepared installs with no prepared requests
            req.done.set()
        for row in list(self._rows):
            self._finish(row, "abort", [], "")
        self._rows = []
        while self._waiting:
            sub = self._waiting.popleft()
            self._forget(sub.request.request_id)
            self._outbox.send(sub.client, Unavailable("the engine stopped before serving this request"))
        self._outbox.flush()

    # ---- one step ----------------------------------------------------------------------------

    def _new_cache(self):
        """An empty batch cache with room for ``max_batch_size`` rows (rows join without a copy)."""
        return self.runner.new_batch_cache(self.config.max_batch_size, self.max_context, self.config.k + 1)

    def _step_or_fail(self) -> None:
        try:
            self._step()
        except Exception as e:
            log.exception(
                "verify step failed; ending the %d requests of the batch", len(self._rows)
            )
            for row in self._rows:
                self._fail(row, RequestError(f"engine step failed: {e}"))
            self._rows = []
            if self._cache.fixed_capacity is not None:  # its stores and the graphs made on them stay
                self._cache.clear()
            else:
                self._cache = self._new_cache()

    def _step(self) -> None:
        rows = self._rows
        batch = len(rows)
        room = np.array([r.room for r in rows], dtype=np.int64)  # [B]
        drafter = self._drafter
        k = 0
        if drafter is not None and self.config.k > 0:
            state = BatchState(batch, self.config.k, room, getattr(drafter, "mixes_sources", False),
                               getattr(drafter, "branches", 1))
            k = max(0, min(int(self.policy.choose_k(state)), self.config.k))

        t0 = time.perf_counter()
        plan = self._draft(rows, k, room)
        proposed = min(plan.k, k)  # drafted positions (a tree's nodes may be more), before the cut
        catch_up_ms = plan.catch_up_ms
        plan = self._trim(plan, batch)
        self._tell_cut(drafter, rows, plan)
        t1 = time.perf_counter()
        inputs = plan.node_tokens([r.token_ids[-1] for r in rows])  # [B, K+1]
        parents = plan.node_parents()  # [B, K+1]
        if plan.is_tree():
            self._cache.set_tree(tree_depths(parents), tree_ancestors(parents))
        out = self.runner.forward(self._cache, inputs, row_tokens=plan.lengths + 1,  # padding skipped
                                  before_layers=self._outbox.flush)
        result = verify_rows(rows, plan, parents, out)
        num_accepted = result.num_accepted.tolist()
        next_tokens = result.next_tokens.tolist()
        paths = [p[: a + 1] for p, a in zip(result.path.tolist(), num_accepted)]  # node indices
        if plan.is_tree():
            self._cache.commit_paths(paths)
        else:
            self._cache.commit([a + 1 for a in num_accepted])
        t2 = time.perf_counter()
        self.steps += 1

        nodes = inputs.tolist()
        emitted = [[nodes[b][n] for n in p[1:]] + [next_tokens[b]] for b, p in enumerate(paths)]
        feats = path_features(self.runner.features(out), plan, result.path)  # [B, K+1, F] or None
        wants_topk = any(getattr(o, "wants_topk", False) for o in self.observers)
        report, tried = step_report(
            rows, plan, parents, paths, out, emitted, num_accepted, feats, t1 - t0, t2 - t1,
            top_k=self.config.trace_topk if wants_topk else None,
            drafter_version=drafter.version if drafter is not None else "none",
            feature_layers=self.runner.feature_layers,
        )
        self._notify("on_step", report)

        finished: set[int] = set()
        for b, row in enumerate(rows):
            row.stats.verify_steps += 1
            row.stats.drafted_tokens += int(plan.lengths[b])
            row.stats.accepted_tokens += num_accepted[b]
            if self._commit(row, emitted[b], None if feats is None else feats[b]):
                finished.add(id(row))
        # The policy is charged the whole step after the draft: the forward and the verify, and
        # also the report, the observers and each row's tokens, which grow with what was accepted
        # (at batch 8 with 21 nodes ~8 ms against ~1.7 for a plain step: left out, widths that
        # lost looked like gains).
        try:
            self._observe(k, plan, tried, num_accepted, report, (time.perf_counter() - t1) * 1e3,
                          proposed, catch_up_ms)
        except Exception:
            log.exception("speculation policy failed to observe a step")
        if finished:
            self._drop_rows(finished)

    def _draft(self, rows: list[Row], k: int, room: np.ndarray) -> DraftPlan:
        drafter = self._drafter
        if drafter is None or k == 0:
            return DraftPlan.none(len(rows))
        caps = np.minimum(k, room - 1)  # [B] a row never drafts past what it may emit
        ask = [b for b, r in enumerate(rows) if r.draft_ok and caps[b] > 0]
        if not ask:
            return DraftPlan.none(len(rows))
        try:
            proposal = drafter.propose([rows[b].view for b in ask], int(caps[ask].max()))
            return plan_from_proposal(proposal, ask, caps, len(rows), self.vocab_size,
                                      max_nodes=self.config.k)
        except Exception:
            self.drafter_errors += 1
            if self.drafter_errors <= 10 or self.drafter_errors % 1000 == 0:
                log.exception(
                    "drafter %s failed to propose (%d so far)", drafter.kind, self.drafter_errors
                )
            return DraftPlan.none(len(rows))

    def _trim(self, plan: DraftPlan, batch: int) -> DraftPlan:
        """Let a tree-aware policy cut each row's drafts to the nodes that pay (confidences)."""
        widths_for = getattr(self.policy, "choose_widths", None)
        if widths_for is None or plan.k == 0 or plan.confidence is None:
            return plan
        try:
            widths = widths_for(plan.node_parents(), plan.confidence, plan.lengths, batch)  # [B]
        except Exception:
            log.exception("speculation policy failed to choose the widths")
            return plan
        return trim_plan(plan, widths)

    def _tell_cut(self, drafter, rows: list[Row], plan: DraftPlan) -> None:
        """A drafter that keeps its own acceptance trials (the hybrid's learned part) learns how
        much of each row's draft is verified: the plan keeps a prefix of the proposal's nodes (the
        row's room, the engine's width, the policy's widths), and a node never verified is no trial."""
        cut = getattr(drafter, "on_cut", None)
        if cut is None:
            return
        try:
            cut({r.request_id: n for r, n in zip(rows, plan.lengths.tolist())})
        except Exception:
            log.exception("drafter %s failed to take the verified widths", drafter.kind)

    def _observe(self, k: int, plan: DraftPlan, tried, num_accepted, report: VerifyBatch,
                 step_ms: float, proposed: int, catch_up_ms: float) -> None:
        """Policy: per-row verified path lengths (acceptance trials), the width that was paid
        (``step_ms``: the step's milliseconds after the draft), the drafted positions the
        draft's milliseconds bought (``proposed``, before the width step's cut) and the part of
        them that committed backlogs (``catch_up_ms``)."""
        if getattr(self.policy, "choose_widths", None) is not None:
            self.policy.observe(
                k,
                tried,
                np.asarray(num_accepted),
                report.draft_ms,
                step_ms,
                width=plan.k,
                batch=len(num_accepted),
                nodes=sum(plan.lengths.tolist()),  # not a torch op: one took ~0.2 ms at batch 8
                proposed=proposed,
                catch_up_ms=catch_up_ms,
            )
        else:
            self.policy.observe(k, plan.lengths.numpy(), np.asarray(num_accepted), report.draft_ms, step_ms)

    # ---- observers ---------------------------------------------------------------------------

    def _notify(self, method: str, *args) -> None:
        notify(self.observers, method, *args)


def _eos_ids(target: Target) -> frozenset[int]:
    model = target.model
    return eos_token_ids(getattr(model, "generation_config", None), model.config, target.tokenizer)
