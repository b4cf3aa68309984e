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
import concurrent.futures
import dataclasses
import logging
import math
import threading
import time
from collections.abc import AsyncIterator

import numpy as np
import torch

from feedback.priority import lower_thread_priority
from kernels.sampling import probs_from_logits
from kernels.tree_verify import (
    TreeVerifyResult,
    greedy_tree_verify,
    sampled_tree_verify,
    tree_ancestors,
    tree_depths,
)
from kernels.verify import rejection_verify
from serving.drafters.base import Drafter, DraftRequestView
from serving.engine.base import (
    GenerationChunk,
    GenerationRequest,
    Overloaded,
    RequestError,
    VerifyBatch,
)
from serving.engine.batch_cache import RaggedKVCache
from serving.engine.config import EngineConfig
from serving.engine.drafting import DraftPlan, plan_from_proposal
from serving.engine.llama_forward import LlamaForward
from serving.engine.policy import BatchState, FixedK, SpeculationPolicy
from serving.engine.rows import Client, Row, Submission
from serving.engine.seeded import position_uniforms
from serving.engine.tree import linear_view, trim_plan
from serving.observers import notify
from serving.output import apply_stops, eos_token_ids
from serving.target import Target

log = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

_PREPARE_ROUNDS = 3
"""Snapshots a prepared swap takes: each one prepares the requests that joined during the last."""


@dataclasses.dataclass
class _Snapshot:
    """A running request as the step thread saw it between two steps (for a prepared swap)."""

    row: Row  # identity only: the preparing thread reads nothing else of it
    view: DraftRequestView  # frozen copy, no RNG
    feature_chunks: list[torch.Tensor] | None
    """The row's history features for the drafter's layers (chunks, never written to once made;
    [len - 1, F] together), when it wants them and the row kept them."""

    @property
    def features(self) -> torch.Tensor | None:
        c = self.feature_chunks
        return None if c is None else c[0] if len(c) == 1 else torch.cat(c, dim=0)


@dataclasses.dataclass
class _SnapshotRequest:
    layers: tuple[int, ...]
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    rows: list[_Snapshot] | None = None


@dataclasses.dataclass
class _PendingSwap:
    drafter: Drafter | None
    prepared: dict[str, tuple[Row, int]] = dataclasses.field(default_factory=dict)
    """request id -> (its row, history length the drafter was prepared with)"""


class TorchEngine:
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
        attn = getattr(self.model.config, "_attn_implementation", "sdpa") or "sdpa"
        if attn not in ("sdpa", "eager"):
            raise ValueError(f"TorchEngine supports sdpa or eager attention, not {attn!r}")
        self._additive_mask = attn == "eager"
        self._fast = None  # our own forward (LlamaForward) when the model allows it
        if cfg.forward == "auto" and attn == "sdpa" and LlamaForward.supports(self.model):
            self._fast = LlamaForward(self.model)
        self.eos_ids = _eos_ids(target)
        self.observers = list(observers)
        self.policy: SpeculationPolicy = policy or FixedK(cfg.k)

        self._drafter: Drafter | None = drafter
        self._feature_layers = self._layers_for(drafter)
        self._pending_swap: _PendingSwap | None = None
        self._swap_lock = threading.Lock()  # _pending_swap, _swap_seq
        self._swap_seq = 0  # swap_drafter calls so far: only the latest one is installed
        self._preparer: concurrent.futures.ThreadPoolExecutor | None = None  # under _swap_lock
        self._snapshot_wanted: list[_SnapshotRequest] = []  # under _cv

        self._cv = threading.Condition()
        self._inbox: list[Submission] = []
        self._abort_ids: set[str] = set()
        self._in_flight: set[str] = set()
        self._stopping = False
        self._thread: threading.Thread | None = None

        # Owned by the step thread.
        self._waiting: collections.deque[Submission] = collections.deque()
        self._rows: list[Row] = []
        self._cache = RaggedKVCache.for_model(self.model)
        self.steps = 0
        self.drafter_errors = 0
        self.refused_overload = 0  # requests refused by admission control (HTTP 429)

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
        with self._swap_lock:
            preparer, self._preparer = self._preparer, None
        if preparer is not None:
            preparer.shutdown(wait=False)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        self._validate(request)
        self._start_thread()
        client = Client(asyncio.get_running_loop(), asyncio.Queue())
        with self._cv:
            if self._stopping:
                raise RequestError("the engine is stopping")
            if request.request_id in self._in_flight:
                raise RequestError(
                    f"request id {request.request_id!r} is already running", invalid=True
                )
            cap = self.config.max_waiting
            if cap is not None and len(self._in_flight) >= self.config.max_batch_size + cap:
                self.refused_overload += 1
                raise Overloaded(
                    f"the engine is at capacity ({len(self._in_flight)} requests running or "
                    f"queued); retry after {self.config.retry_after_s:g}s",
                    self.config.retry_after_s,
                )
            self._in_flight.add(request.request_id)
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

    def swap_drafter(self, drafter: Drafter | None) -> None:
        """Install ``drafter`` between two steps; running requests move to it (removed from the old
        one) and keep going. The latest call wins.

        A drafter with ``prepare_request`` (PreparableDrafter) is prepared off the step thread: the
        step thread hands over a snapshot of the running requests between two steps, the drafter
        builds their state (e.g. prefills its draft KV cache) on a low-priority helper thread
        (``EngineConfig.swap_prepare_nice``; this call waits for it unless it is made from an event
        loop), and the step thread then only installs it, catching each request up with the
        tokens committed since the snapshot. Other drafters, and requests not prepared within
        ``swap_prepare_timeout_s``, get their full history at install (``add_request``), with
        target features rebuilt when the drafter wants them."""
        with self._swap_lock:
            self._swap_seq += 1
            seq = self._swap_seq
        if not self._preparable(drafter):
            self._set_pending(seq, _PendingSwap(drafter))
            return
        done = self._preparer_pool().submit(self._prepare_swap, seq, drafter)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            done.result()  # never raises: a failed preparation installs unprepared

    def _preparable(self, drafter: Drafter | None) -> bool:
        thread = self._thread
        return (
            drafter is not None
            and callable(getattr(drafter, "prepare_request", None))
            and thread is not None
            and thread.is_alive()
            and thread is not threading.current_thread()
            and drafter is not self._drafter  # in use by the step thread: rebuild it there
        )

    def _preparer_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._swap_lock:
            if self._preparer is None:
                self._preparer = concurrent.futures.ThreadPoolExecutor(
                    1, "specloop-swap-prepare", initializer=self._lower_priority
                )
            return self._preparer

    def _lower_priority(self) -> None:
        """Preparer thread: nicer by ``swap_prepare_nice``."""
        lower_thread_priority(self.config.swap_prepare_nice, "swap preparer")

    def _set_pending(self, seq: int, pending: _PendingSwap) -> None:
        with self._swap_lock:
            if seq != self._swap_seq:  # a later swap_drafter call superseded this one
                return
            self._pending_swap = pending
        with self._cv:
            self._cv.notify_all()
        if self._thread is None:  # not running: nothing in flight, apply now
            self._apply_swap()

    def _prepare_swap(self, seq: int, drafter: Drafter) -> None:
        """Preparer thread: build ``drafter``'s state for the running requests, then hand it to the
        step thread. ``drafter`` is not shared with the step thread until it is installed."""
        pending = _PendingSwap(drafter)
        t0 = time.perf_counter()
        try:
            with self._swap_lock:
                live = self._drafter, self._pending_swap and self._pending_swap.drafter
            if any(d is drafter for d in live):  # the step thread has it: rebuild it there
                self._set_pending(seq, pending)
                return
            with torch.no_grad():
                self._prepare_rows(seq, drafter, pending, t0 + self.config.swap_prepare_timeout_s)
        except Exception:
            log.exception("preparing drafter %s failed; rows are rebuilt at install", drafter.kind)
        log.info(
            "drafter %s %s prepared for %d requests in %.1f ms",
            drafter.kind,
            drafter.version,
            len(pending.prepared),
            (time.perf_counter() - t0) * 1e3,
        )
        self._set_pending(seq, pending)

    def _prepare_rows(
        self, seq: int, drafter: Drafter, pending: _PendingSwap, deadline: float
    ) -> None:
        layers = tuple(drafter.feature_layers or ())
        for _ in range(_PREPARE_ROUNDS):
            with self._swap_lock:
                if seq != self._swap_seq:  # superseded: whatever follows replaces it
                    return
            snap = self._snapshot(layers)
            if not snap:  # nothing running, or the engine stopped
                return
            todo = [
                s for s in snap if pending.prepared.get(s.view.request_id, (None,))[0] is not s.row
            ]
            if not todo:
                return
            for s in todo:
                if time.perf_counter() > deadline:
                    log.warning(
                        "drafter %s: preparation timed out; remaining requests are rebuilt at "
                        "install",
                        drafter.kind,
                    )
                    return
                rid = s.view.request_id
                pending.prepared.pop(rid, None)
                if layers and s.feature_chunks is None:
                    continue  # no history features to hand over: added at install
                try:
                    drafter.prepare_request(s.view, s.features)
                except Exception:
                    log.exception(
                        "drafter %s failed to prepare %s; it is added at install", drafter.kind, rid
                    )
                    continue
                pending.prepared[rid] = (s.row, len(s.view.token_ids))

    def _snapshot(self, layers: tuple[int, ...]) -> list[_Snapshot] | None:
        """The running requests, handed over by the step thread between two steps."""
        req = _SnapshotRequest(layers)
        with self._cv:
            if self._stopping or self._thread is None:
                return None
            self._snapshot_wanted.append(req)
            self._cv.notify_all()
        while not req.done.wait(0.5):
            thread = self._thread
            if thread is None or not thread.is_alive():
                return None
        return req.rows

    def _serve_snapshots(self, wanted: list[_SnapshotRequest]) -> None:
        """Step thread, between two steps: copy what a prepared swap needs of each row."""
        for req in wanted:
            try:
                rows = []
                for row in self._rows:
                    view = dataclasses.replace(
                        row.view, token_ids=list(row.token_ids), generator=None
                    )
                    chunks = None
                    if self._has_features(row, req.layers):
                        chunks = list(row.features)  # the preparing thread concatenates them
                    rows.append(_Snapshot(row, view, chunks))
                req.rows = rows
            finally:
                req.done.set()

    @staticmethod
    def _has_features(row: Row, layers: tuple[int, ...]) -> bool:
        """The row kept features for ``layers`` for its whole history (every token in the KV)."""
        return (
            bool(layers)
            and row.features_layers == layers
            and sum(int(f.shape[0]) for f in row.features) == len(row.token_ids) - 1
        )

    # ---- thread plumbing ---------------------------------------------------------------------

    def _start_thread(self) -> None:
        with self._cv:
            if self._thread is not None:
                return
            if self.config.num_threads:
                torch.set_num_threads(self.config.num_threads)
            self._announce_drafter()
            self._thread = threading.Thread(target=self._run, name="specloop-engine", daemon=True)
            self._thread.start()

    def _request_abort(self, request_id: str) -> None:
        with self._cv:
            if request_id in self._in_flight:
                self._abort_ids.add(request_id)
                self._cv.notify_all()

    def _validate(self, request: GenerationRequest) -> None:
        def bad(msg: str):
            raise RequestError(msg, invalid=True)

        if not isinstance(request.request_id, str) or not request.request_id:
            bad("request_id must be a non-empty string")
        ids = request.prompt_ids
        if not isinstance(ids, (list, tuple)) or len(ids) == 0:
            bad("the prompt is empty")
        if not all(_is_int(t) and 0 <= t < self.vocab_size for t in ids):
            bad(f"prompt token ids must be integers in [0, {self.vocab_size})")
        if len(ids) >= self.max_context:
            bad(
                f"the prompt has {len(ids)} tokens; the context holds {self.max_context} "
                "(prompt + at least one output token)"
            )
        p = request.params
        if not (math.isfinite(p.temperature) and p.temperature >= 0):
            bad("temperature must be a finite number >= 0")
        if not (0 < p.top_p <= 1):
            bad("top_p must be in (0, 1]")
        if p.top_k < 0 or p.max_tokens < 1:
            bad("top_k must be >= 0 and max_tokens >= 1")
        if not all(_is_int(t) for t in p.stop_token_ids):
            bad("stop_token_ids must be integers")

    def _run(self) -> None:
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
                try:
                    self._apply_swap()
                    self._apply_aborts(aborts)
                    self._admit()
                    self._serve_snapshots(wanted)
                    if self._rows:
                        self._step_or_fail()
                except Exception:  # never let the loop die
                    log.exception("engine loop error")
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
            sub.client.send(RequestError("the engine stopped"))

    def _forget(self, request_id: str) -> None:
        with self._cv:
            self._in_flight.discard(request_id)

    # ---- membership --------------------------------------------------------------------------

    def _apply_aborts(self, ids: set[str]) -> None:
        if not ids:
            return
        for sub in [s for s in self._waiting if s.request.request_id in ids]:
            self._waiting.remove(sub)
            self._forget(sub.request.request_id)
            sub.client.send(
                GenerationChunk(
                    request_id=sub.request.request_id,
                    token_ids=[],
                    text="",
                    finished=True,
                    finish_reason="abort",
                    prompt_tokens=len(sub.request.prompt_ids),
                )
            )
        gone = [r for r in self._rows if r.request_id in ids]
        for row in gone:
            self._finish(row, "abort", [], "")
        if gone:
            self._drop_rows({id(r) for r in gone})

    def _admit(self) -> None:
        while self._waiting and len(self._rows) < self.config.max_batch_size:
            sub = self._waiting.popleft()
            try:
                row = Row(sub, self.tokenizer, self.eos_ids, self.max_context)
                cache, feats = self._prefill(row.token_ids)
                self._cache.append(cache)
            except Exception as e:
                log.exception("admission failed for %s", sub.request.request_id)
                self._forget(sub.request.request_id)
                sub.client.send(RequestError(f"prefill failed: {e}"))
                continue
            self._rows.append(row)
            if self._drafter is not None and self._drafter.feature_layers:
                row.features, row.features_layers = [feats], self._feature_layers
            self._add_to_drafter(row, feats)
            self._notify_start(row, feats)

    def _drop_rows(self, ids: set[int]) -> None:
        keep = [i for i, r in enumerate(self._rows) if id(r) not in ids]
        self._rows = [self._rows[i] for i in keep]
        self._cache.keep_rows(keep)

    # ---- model calls -------------------------------------------------------------------------

    def _forward(self, cache: RaggedKVCache, input_ids: torch.Tensor, logits_to_keep: int = 0):
        """One target forward of ``input_ids`` [B, q] appended to ``cache``."""
        positions, mask = cache.prepare(input_ids.shape[1])  # [B, q], [B, 1, q, L]
        if self._fast is not None:
            return self._fast(
                input_ids.to(self.device),
                positions,
                mask,
                cache,
                logits_to_keep=logits_to_keep,
                hidden_layers=self._feature_layers,
            )
        if self._additive_mask:
            mask = torch.zeros(mask.shape, dtype=self.model.dtype, device=mask.device).masked_fill(
                ~mask, torch.finfo(self.model.dtype).min
            )
        return self.model(
            input_ids=input_ids.to(self.device),
            position_ids=positions,
            attention_mask=mask,
            past_key_values=cache,
            use_cache=True,
            output_hidden_states=bool(self._feature_layers),
            logits_to_keep=logits_to_keep,
        )

    def _features(self, out) -> torch.Tensor | None:
        if not self._feature_layers:
            return None
        return torch.cat([out.hidden_states[i] for i in self._feature_layers], dim=-1)  # [B, q, F]

    def _prefill(self, prompt_ids: list[int]) -> tuple[RaggedKVCache, torch.Tensor | None]:
        """Batch-1 cache holding prompt[:-1], and its features [P-1, F] (None if not captured)."""
        cache = RaggedKVCache.for_model(self.model, batch_size=1)
        n = len(prompt_ids) - 1
        if n == 0:
            feats = None
            if self._feature_layers:
                feats = torch.zeros(
                    0, self._feature_dim(), dtype=self.model.dtype, device=self.device
                )
            return cache, feats
        out = self._forward(cache, torch.tensor([prompt_ids[:-1]]), logits_to_keep=1)
        cache.commit([n])
        feats = self._features(out)
        return cache, None if feats is None else feats[0]

    def _feature_dim(self) -> int:
        return int(self.model.config.hidden_size) * len(self._feature_layers)

    # ---- one step ----------------------------------------------------------------------------

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
            self._cache = RaggedKVCache.for_model(self.model)

    def _step(self) -> None:
        rows = self._rows
        batch = len(rows)
        room = np.array([r.room for r in rows], dtype=np.int64)  # [B]
        drafter = self._drafter
        k = 0
        if drafter is not None and self.config.k > 0:
            state = BatchState(batch, self.config.k, room, drafter.kind)
            k = max(0, min(int(self.policy.choose_k(state)), self.config.k))

        t0 = time.perf_counter()
        plan = self._draft(rows, k, room)
        plan = self._trim(plan, batch)
        t1 = time.perf_counter()
        last = torch.tensor([r.token_ids[-1] for r in rows], dtype=torch.long)  # [B]
        inputs = plan.node_tokens(last)  # [B, K+1]
        parents = plan.node_parents()  # [B, K+1]
        if plan.is_tree():
            self._cache.set_tree(tree_depths(parents), tree_ancestors(parents))
        out = self._forward(self._cache, inputs)
        logits = out.logits  # [B, K+1, V]
        result = self._verify(rows, plan, parents, logits)
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
        feats = self._features(out)  # [B, K+1, F] or None
        if feats is not None and plan.is_tree():  # inputs along the path first: [B, K+1, F]
            index = result.path.clamp(min=0).to(feats.device)
            feats = feats.gather(1, index[:, :, None].expand(-1, -1, feats.shape[-1]))
        view_plan, view_logits, tried = linear_view(plan, parents, logits, paths)
        report = self._report(
            rows, view_plan, view_logits, emitted, num_accepted, feats, t1 - t0, t2 - t1
        )
        if plan.is_tree():
            valid = np.arange(plan.k)[None, :] < plan.lengths.numpy()[:, None]  # [B, K]
            report.tree_nodes = plan.lengths.numpy().astype(np.int16)
            report.tree_ids = np.where(valid, plan.tokens.numpy(), -1).astype(np.int32)
            report.tree_parents = np.where(valid, plan.parents.numpy(), -1).astype(np.int16)
        self._notify("on_step", report)
        try:
            self._observe(k, plan, tried, num_accepted, report)
        except Exception:
            log.exception("speculation policy failed to observe a step")

        finished: set[int] = set()
        for b, row in enumerate(rows):
            row.stats.verify_steps += 1
            row.stats.drafted_tokens += int(plan.lengths[b])
            row.stats.accepted_tokens += num_accepted[b]
            if self._commit(row, emitted[b], None if feats is None else feats[b]):
                finished.add(id(row))
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
            return plan_from_proposal(proposal, ask, caps, len(rows), self.vocab_size)
        except Exception:
            self.drafter_errors += 1
            if self.drafter_errors <= 10 or self.drafter_errors % 1000 == 0:
                log.exception(
                    "drafter %s failed to propose (%d so far)", drafter.kind, self.drafter_errors
                )
            return DraftPlan.none(len(rows))

    def _trim(self, plan: DraftPlan, batch: int) -> DraftPlan:
        """Let a tree-aware policy cut the drafts to the node count that pays (confidences)."""
        width_for = getattr(self.policy, "choose_width", None)
        if width_for is None or plan.k == 0 or plan.confidence is None:
            return plan
        try:
            width = int(width_for(plan.node_parents(), plan.confidence, plan.lengths, batch))
        except Exception:
            log.exception("speculation policy failed to choose a width")
            return plan
        return trim_plan(plan, width)

    def _observe(self, k: int, plan: DraftPlan, tried, num_accepted, report: VerifyBatch) -> None:
        """Policy: per-row verified path lengths (acceptance trials) and the width that was paid."""
        if getattr(self.policy, "choose_width", None) is not None:
            self.policy.observe(
                k,
                tried,
                np.asarray(num_accepted),
                report.draft_ms,
                report.verify_ms,
                width=plan.k,
                batch=len(num_accepted),
            )
        else:
            self.policy.observe(
                k, plan.lengths.numpy(), np.asarray(num_accepted), report.draft_ms, report.verify_ms
            )

    def _verify(
        self, rows: list[Row], plan: DraftPlan, parents: torch.Tensor, logits: torch.Tensor
    ) -> TreeVerifyResult:
        """Accept each row's longest path the target agrees with (a chain is a one-branch tree)."""
        device = logits.device
        batch, n = parents.shape
        tokens = torch.cat([torch.zeros(batch, 1, dtype=torch.long), plan.tokens], 1).to(device)
        parents = parents.to(device)  # [B, K+1]
        sampled = [b for b, r in enumerate(rows) if r.params.temperature > 0]
        if not sampled:
            return greedy_tree_verify(tokens, parents, logits)
        num_accepted = torch.zeros(batch, dtype=torch.long, device=device)
        next_tokens = torch.zeros(batch, dtype=torch.long, device=device)
        path = torch.full((batch, n), -1, dtype=torch.long, device=device)
        greedy = [b for b in range(batch) if rows[b].params.temperature == 0]
        if greedy:
            g = torch.tensor(greedy, device=device)
            res = greedy_tree_verify(tokens[g], parents[g], logits[g])
            num_accepted[g], next_tokens[g], path[g] = res.num_accepted, res.next_tokens, res.path
        s = torch.tensor(sampled, device=device)
        srows = [rows[b] for b in sampled]
        probs = probs_from_logits(
            logits[s],
            torch.tensor([r.params.temperature for r in srows], device=device),
            torch.tensor([r.params.top_k for r in srows], device=device),
            torch.tensor([r.params.top_p for r in srows], device=device),
        )  # [Bs, K+1, V]
        if plan.dists is None:
            depth = tree_depths(parents[s]).cpu().numpy()  # [Bs, K+1]
            first = np.array([r.num_output for r in srows], dtype=np.int64)[:, None]
            u = position_uniforms([r.seed for r in srows], first + depth)  # [Bs, K+1]
            res = sampled_tree_verify(tokens[s], parents[s], probs, torch.from_numpy(u).to(device))
            num_accepted[s], next_tokens[s], path[s] = res.num_accepted, res.next_tokens, res.path
        else:  # chains of drafts with distributions: lossless rejection sampling
            chain = rejection_verify(
                plan.tokens.to(device)[s],
                plan.lengths.to(device)[s],
                plan.probs.to(device)[s],
                plan.dists.to(device)[s],
                probs,
                [r.generator for r in srows],
            )
            steps = torch.arange(n, device=device)[None, :]  # [1, K+1]
            num_accepted[s], next_tokens[s] = chain.num_accepted, chain.next_tokens
            path[s] = torch.where(steps <= chain.num_accepted[:, None], steps, -1)
        return TreeVerifyResult(num_accepted, next_tokens, path)

    def _trace_topk(
        self, rows: list[Row], plan: DraftPlan, logits: torch.Tensor
    ) -> tuple[np.ndarray, np.ndarray]:
        """Target top-k (ids, log-probs) at the verified positions of rows that are traced.

        Only positions j <= num_drafted of rows with ``train`` set are computed (one gather, one
        top-k, one logsumexp over [N, V]); the rest stay padded (-1 / -inf)."""
        b, k1, vocab = logits.shape
        t = min(self.config.trace_topk, vocab)
        device = logits.device
        verified = torch.arange(k1, device=device)[None, :] <= plan.lengths.to(device)[:, None]
        traced = torch.tensor([r.request.train for r in rows], device=device)
        keep = verified & traced[:, None]  # [B, K+1]
        sel = logits[keep]  # [N, V]
        values, ids = sel.topk(t, dim=-1)  # [N, T]
        lp = values.float() - torch.logsumexp(sel.float(), dim=-1, keepdim=True)  # [N, T]
        topk_ids = np.full((b, k1, t), -1, dtype=np.int32)
        topk_lp = np.full((b, k1, t), -np.inf, dtype=np.float16)
        mask = keep.cpu().numpy()
        topk_ids[mask] = ids.to(torch.int32).cpu().numpy()
        topk_lp[mask] = lp.to(torch.float16).cpu().numpy()
        return topk_ids, topk_lp

    def _report(
        self,
        rows: list[Row],
        plan: DraftPlan,
        logits: torch.Tensor,
        emitted: list[list[int]],
        num_accepted: list[int],
        feats: torch.Tensor | None,
        draft_s: float,
        verify_s: float,
    ) -> VerifyBatch:
        """The step as observers see it (numpy, CPU)."""
        k = plan.k
        lengths = plan.lengths.numpy()
        in_len = np.arange(k)[None, :] < lengths[:, None]  # [B, K]
        topk_ids = topk_lp = None
        if any(getattr(o, "wants_topk", False) for o in self.observers) and any(
            r.request.train for r in rows
        ):
            topk_ids, topk_lp = self._trace_topk(rows, plan, logits)
        features = None
        if feats is not None:
            bits = (
                feats.to(torch.bfloat16).view(torch.int16).cpu().numpy().view(np.uint16)
            )  # [B, K+1, F]
            features = [bits[b, : a + 1] for b, a in enumerate(num_accepted)]
        drafter = self._drafter
        return VerifyBatch(
            request_ids=[r.request_id for r in rows],
            positions=np.array([r.num_output for r in rows], dtype=np.int32),
            num_drafted=lengths.astype(np.int16),
            num_accepted=np.asarray(num_accepted, dtype=np.int16),
            source=plan.source,
            draft_ids=np.where(in_len, plan.tokens.numpy(), -1).astype(np.int32),
            draft_probs=np.where(in_len, plan.probs.numpy(), 0.0).astype(np.float32),
            emitted=emitted,
            target_topk_ids=topk_ids,
            target_topk_logprobs=topk_lp,
            features=features,
            draft_ms=draft_s * 1000.0,
            verify_ms=verify_s * 1000.0,
            drafter_version=drafter.version if drafter is not None else "none",
            feature_layers=self._feature_layers if feats is not None else (),
        )

    def _commit(self, row: Row, emitted: list[int], feats: torch.Tensor | None) -> bool:
        """Apply one step's tokens to a row: stop tokens, stop strings, length. True if finished."""
        pushed = apply_stops(row.text, row.stop_ids, emitted)  # shared with SGLangEngine
        emitted, reason = pushed.tokens, ("stop" if pushed.stopped else None)
        row.token_ids.extend(emitted)
        if reason is None and row.room <= 0:
            reason = "length"
        kept = None if feats is None else feats[: len(emitted)]  # [n, F]
        if row.draft_ok and self._drafter is not None:
            try:
                self._drafter.on_verified(
                    row.request_id, emitted, kept if self._drafter.feature_layers else None
                )
            except Exception:
                log.exception("drafter.on_verified failed for %s", row.request_id)
        if reason is None:
            if row.features_layers and kept is not None:
                row.features.append(kept)
            if not row.client.send(row.chunk(emitted, pushed.text, None)):
                self._request_abort(row.request_id)  # the caller's event loop is gone
            return False
        text = pushed.text + row.text.flush()
        self._finish(row, reason, emitted, text)
        return True

    def _finish(self, row: Row, reason: str, tokens: list[int], text: str) -> None:
        self._forget(row.request_id)
        row.client.send(row.chunk(tokens, text, reason))
        if self._drafter is not None and row.draft_ok:
            try:
                # an opted-out request ("train": false) leaves nothing that outlives it: its output
                # must not reach the tenant's shared suffix index (nor any learning drafter)
                keep = reason != "abort" and row.request.train
                self._drafter.remove_request(row.request_id, row.output_ids if keep else None)
            except Exception:
                log.exception("drafter.remove_request failed for %s", row.request_id)
        self._notify("on_request_finish", row.request, row.output_ids, reason, row.stats)

    def _fail(self, row: Row, error: RequestError) -> None:
        self._forget(row.request_id)
        row.client.send(error)
        if self._drafter is not None and row.draft_ok:
            try:
                self._drafter.remove_request(row.request_id, None)
            except Exception:
                log.exception("drafter.remove_request failed for %s", row.request_id)
        self._notify("on_request_finish", row.request, row.output_ids, "error", row.stats)

    # ---- drafter management ------------------------------------------------------------------

    def _layers_for(self, drafter: Drafter | None) -> tuple[int, ...]:
        if drafter is not None and drafter.feature_layers:
            return tuple(drafter.feature_layers)
        return tuple(self.config.feature_layers) if self.config.capture_features else ()

    def _add_to_drafter(self, row: Row, feats: torch.Tensor | None) -> None:
        drafter = self._drafter
        row.draft_ok = drafter is not None
        if drafter is None:
            return
        try:
            drafter.add_request(row.view, feats if drafter.feature_layers else None)
        except Exception:
            row.draft_ok = False
            log.exception(
                "drafter %s refused request %s; it decodes without drafts",
                drafter.kind,
                row.request_id,
            )

    def _apply_swap(self) -> None:
        with self._swap_lock:
            pending, self._pending_swap = self._pending_swap, None
        if pending is None:
            return
        new, old = pending.drafter, self._drafter
        for row in self._rows:
            if old is not None and row.draft_ok:
                try:
                    old.remove_request(row.request_id, None)
                except Exception:
                    log.exception("old drafter failed to drop %s", row.request_id)
        prepared = dict(pending.prepared)
        running = {row.request_id: row for row in self._rows}
        for rid, (row, _) in list(prepared.items()):
            if running.get(rid) is not row:  # ended (or its id was reused) since the snapshot
                del prepared[rid]
                try:
                    new.remove_request(rid, None)
                except Exception:
                    log.exception("new drafter failed to drop %s", rid)
        self._drafter = new
        self._feature_layers = self._layers_for(new)
        wants = new is not None and bool(new.feature_layers)
        caught_up = 0
        for row in self._rows:
            if not wants:  # nobody needs the history any more
                row.features, row.features_layers = [], ()
            done = prepared.get(row.request_id, (None, 0))[1]
            if done and self._catch_up(row, done, self._feature_layers if wants else ()):
                caught_up += 1
                continue
            self._add_to_drafter(row, self._history_features(row) if wants else None)
        log.info(
            "drafter swapped to %s %s (%d requests in flight, %d prepared off the step thread)",
            new.kind if new else "none",
            new.version if new else "-",
            len(self._rows),
            caught_up,
        )
        self._announce_drafter()

    def _catch_up(self, row: Row, done: int, layers: tuple[int, ...]) -> bool:
        """Feed a prepared row's tokens committed since its snapshot to the new drafter (True), or
        give up (False: the row is then re-added with its full history)."""
        tail = row.token_ids[done:]
        feats = None
        if layers and tail:
            if not self._has_features(row, layers):
                return False
            need, parts = len(tail), []  # the inputs of the steps since the snapshot: the last
            for chunk in reversed(row.features):  # len(tail) feature rows
                parts.append(chunk[max(0, int(chunk.shape[0]) - need) :])
                need -= parts[-1].shape[0]
                if need == 0:
                    break
            feats = parts[0] if len(parts) == 1 else torch.cat(parts[::-1], dim=0)  # [len(tail), F]
        try:
            if tail:
                self._drafter.on_verified(row.request_id, tail, feats)
        except Exception:
            log.exception("drafter %s failed to catch %s up", self._drafter.kind, row.request_id)
            return False
        row.draft_ok = True
        return True

    def _history_features(self, row: Row) -> torch.Tensor:
        """Features of every token in the row's KV cache, for the current feature layers;
        recomputed with one target forward when the history holds other layers (or none)."""
        if row.features_layers == self._feature_layers and row.features:
            feats = torch.cat(row.features, dim=0)  # [len-1, F]
            if feats.shape[0] == len(row.token_ids) - 1:
                row.features = [feats]
                return feats
        ids = row.token_ids[:-1]
        if ids:
            out = self.model(
                input_ids=torch.tensor([ids], device=self.device),
                use_cache=False,
                output_hidden_states=True,
                logits_to_keep=1,
            )
            feats = self._features(out)[0]  # [len-1, F]
        else:
            feats = torch.zeros(0, self._feature_dim(), dtype=self.model.dtype, device=self.device)
        row.features, row.features_layers = [feats], self._feature_layers
        return feats

    def _announce_drafter(self) -> None:
        d = self._drafter
        self._notify("on_drafter_change", d.kind if d else "none", d.version if d else "none")

    # ---- observers ---------------------------------------------------------------------------

    def _notify(self, method: str, *args) -> None:
        notify(self.observers, method, *args)

    def _notify_start(self, row: Row, feats: torch.Tensor | None) -> None:
        if feats is None:
            self._notify("on_request_start", row.request)
            return
        bits = feats.to(torch.bfloat16).view(torch.int16).cpu().numpy().view(np.uint16)  # [P-1, F]
        self._notify("on_request_start", row.request, bits)


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _eos_ids(target: Target) -> frozenset[int]:
    model = target.model
    return eos_token_ids(getattr(model, "generation_config", None), model.config, target.tokenizer)
