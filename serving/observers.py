"""Engine-agnostic consumers of verify steps: the StepObserver protocol and the TraceRecorder.

Engines (TorchEngine, SGLangEngine) call observers on their step thread, with data already on the
CPU. Observers must be quick and must not raise into the engine (engines guard the calls anyway).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from feedback.bus.sink import TraceSink
from feedback.bus.trace import StepArrays, TraceRecord
from feedback.target.fingerprint import TargetFingerprint
from serving.engine.base import GenerationRequest, SpecStats, VerifyBatch

log = logging.getLogger(__name__)


@runtime_checkable
class StepObserver(Protocol):
    """What an engine reports. Optional extras an engine looks up with ``getattr``:

    ``wants_topk: bool`` (default False) — the observer reads ``VerifyBatch.target_topk_*``; the
    engine skips the top-k work when no observer wants it.
    ``on_drafter_change(kind: str, version: str)`` — called when the engine starts and after
    every drafter swap takes effect.
    """

    def on_request_start(
        self, request: GenerationRequest, prefill_features: np.ndarray | None = None
    ) -> None:
        """A request joined the running batch. ``prefill_features``: [len(prompt)-1, F] uint16
        (bf16 bits) target features of the prefilled prompt, when the engine captures features."""
        ...

    def on_step(self, batch: VerifyBatch) -> None: ...

    def on_request_finish(
        self,
        request: GenerationRequest,
        output_ids: list[int],
        finish_reason: str,
        stats: SpecStats,
    ) -> None:
        """``output_ids``: every token the request committed (through a stop token; tokens a
        stop string made the engine drop are not included)."""
        ...


def notify(observers, method: str, *args) -> None:
    """Call ``method`` on every observer that has it; an observer that raises is logged, never
    propagated (serving must not fail because a trace or a metric could not be recorded)."""
    for obs in list(observers):
        fn = getattr(obs, method, None)
        if fn is None:
            continue
        try:
            fn(*args)
        except Exception:
            log.exception("observer %s.%s failed", type(obs).__name__, method)


class BaseObserver:
    """No-op defaults, for observers that only care about some events."""

    wants_topk = False

    def on_request_start(self, request, prefill_features=None) -> None:
        pass

    def on_step(self, batch: VerifyBatch) -> None:
        pass

    def on_request_finish(self, request, output_ids, finish_reason, stats) -> None:
        pass

    def on_drafter_change(self, kind: str, version: str) -> None:
        pass


@dataclass
class _OpenTrace:
    request: GenerationRequest
    created_at: float
    positions: list[int] = field(default_factory=list)
    num_drafted: list[int] = field(default_factory=list)
    num_accepted: list[int] = field(default_factory=list)
    source: list[int] = field(default_factory=list)
    draft_ids: list[np.ndarray] = field(default_factory=list)  # per step [K_step]
    draft_probs: list[np.ndarray] = field(default_factory=list)
    topk_ids: list[np.ndarray | None] = field(default_factory=list)  # per step [K_step+1, T]
    topk_logprobs: list[np.ndarray | None] = field(default_factory=list)
    features: list[np.ndarray] = field(default_factory=list)  # [n, F] uint16 chunks
    tree_ids: list[np.ndarray | None] = field(default_factory=list)  # per step [N] or None (chain)
    tree_parents: list[np.ndarray | None] = field(default_factory=list)
    versions: collections.Counter = field(default_factory=collections.Counter)
    feature_layers: tuple[int, ...] = ()


class TraceRecorder(BaseObserver):
    """Builds one TraceRecord per finished request (unless ``request.train`` is False) for a sink.

    Per step it appends the row's slices of the VerifyBatch (no per-token work); at finish it pads
    the steps to a common width and validates the record.

    Drafter version: the record carries the version that proposed the most steps of the request
    (a swap mid-request splits its steps between versions; ties go to the earlier version).
    Drafter kind: ``drafter_kind`` (a string, or a callable read at finish), else the kind last
    announced by the engine through ``on_drafter_change``.

    Stop trimming: a step may verify tokens past the point where the request stopped (a stop token
    or stop string in the middle of its accepted run). The last step is cut to the tokens kept:
    its drafted and accepted counts shrink so that ``sum(accepted + 1) == len(output_ids)``, and
    the rows past the cut are padded. Aborted requests are recorded too (every emitted token was
    verified; finish_reason says "abort").
    """

    wants_topk = True

    def __init__(
        self,
        sink: TraceSink,
        fingerprint: TargetFingerprint,
        drafter_kind: str | Callable[[], str] | None = None,
        record_features: bool = False,
    ):
        self.sink = sink
        self.fingerprint = fingerprint
        self._kind_source = drafter_kind
        self._announced_kind = "none"
        self.record_features = record_features
        self._open: dict[str, _OpenTrace] = {}
        self._lock = threading.Lock()
        self.emitted = 0
        self.failed = 0

    def on_drafter_change(self, kind: str, version: str) -> None:
        self._announced_kind = kind

    def on_request_start(self, request, prefill_features=None) -> None:
        if not request.train:
            return
        trace = _OpenTrace(request, time.time())
        if self.record_features and prefill_features is not None:
            trace.features.append(np.asarray(prefill_features, dtype=np.uint16))
        with self._lock:
            self._open[request.request_id] = trace

    def on_step(self, batch: VerifyBatch) -> None:
        with self._lock:
            open_rows = [(b, self._open.get(rid)) for b, rid in enumerate(batch.request_ids)]
        for b, trace in open_rows:
            if trace is None:
                continue
            nd = int(batch.num_drafted[b])
            trace.positions.append(int(batch.positions[b]))
            trace.num_drafted.append(nd)
            trace.num_accepted.append(int(batch.num_accepted[b]))
            trace.source.append(int(batch.source[b]))
            trace.draft_ids.append(batch.draft_ids[b, :nd])
            trace.draft_probs.append(batch.draft_probs[b, :nd])
            if batch.target_topk_ids is not None and batch.target_topk_logprobs is not None:
                trace.topk_ids.append(batch.target_topk_ids[b, : nd + 1])
                trace.topk_logprobs.append(batch.target_topk_logprobs[b, : nd + 1])
            else:
                trace.topk_ids.append(None)
                trace.topk_logprobs.append(None)
            tree_ids = getattr(batch, "tree_ids", None)
            if tree_ids is not None:
                n = int(batch.tree_nodes[b])
                trace.tree_ids.append(tree_ids[b, :n])
                trace.tree_parents.append(batch.tree_parents[b, :n])
            else:
                trace.tree_ids.append(None)
                trace.tree_parents.append(None)
            trace.versions[batch.drafter_version] += 1
            if self.record_features and batch.features is not None:
                trace.features.append(batch.features[b])
                trace.feature_layers = tuple(getattr(batch, "feature_layers", ()) or ())

    def on_request_finish(self, request, output_ids, finish_reason, stats) -> None:
        with self._lock:
            trace = self._open.pop(request.request_id, None)
        if trace is None:
            return
        try:
            record = self._build(trace, list(output_ids), finish_reason)
        except Exception:  # a malformed trace must never hurt serving
            self.failed += 1
            log.exception("trace for request %s could not be built", request.request_id)
            return
        try:
            self.sink.emit(record)
            self.emitted += 1
        except Exception:
            self.failed += 1
            log.exception("trace sink refused request %s", request.request_id)

    def _drafter_kind(self) -> str:
        src = self._kind_source
        if callable(src):
            return str(src())
        return src if src is not None else self._announced_kind

    def _build(self, t: _OpenTrace, output_ids: list[int], finish_reason: str) -> TraceRecord:
        num_drafted = np.asarray(t.num_drafted, dtype=np.int16)
        num_accepted = np.asarray(t.num_accepted, dtype=np.int16)
        positions = np.asarray(t.positions, dtype=np.int32)
        num_steps = len(positions)
        # Cut the steps to the tokens kept (see class docstring).
        ends = positions.astype(np.int64) + num_accepted + 1
        keep_steps = int(np.searchsorted(positions, len(output_ids), side="left"))
        num_drafted, num_accepted = (
            num_drafted[:keep_steps].copy(),
            num_accepted[:keep_steps].copy(),
        )
        if keep_steps and ends[keep_steps - 1] > len(output_ids):
            kept = len(output_ids) - int(positions[keep_steps - 1])  # >= 1
            num_accepted[-1] = kept - 1
            num_drafted[-1] = kept - 1
        num_steps = keep_steps

        k = int(num_drafted.max()) if num_steps else 0
        widths = [x.shape[-1] for x in t.topk_ids[:num_steps] if x is not None]
        topk = widths[0] if widths else 0
        draft_ids = np.full((num_steps, k), -1, np.int32)
        draft_probs = np.zeros((num_steps, k), np.float32)
        topk_ids = np.full((num_steps, k + 1, topk), -1, np.int32)
        topk_lp = np.full((num_steps, k + 1, topk), -np.inf, np.float16)
        for s in range(num_steps):
            nd = int(num_drafted[s])
            draft_ids[s, :nd] = t.draft_ids[s][:nd]
            draft_probs[s, :nd] = t.draft_probs[s][:nd]
            if t.topk_ids[s] is not None and topk:
                topk_ids[s, : nd + 1] = t.topk_ids[s][: nd + 1]
                topk_lp[s, : nd + 1] = t.topk_logprobs[s][: nd + 1]

        tree_ids = tree_parents = None
        trees = [x for x in t.tree_ids[:num_steps] if x is not None]
        if trees:
            m = max(len(x) for x in trees)
            tree_ids = np.full((num_steps, m), -1, np.int32)
            tree_parents = np.full((num_steps, m), -1, np.int16)
            for s, (ids, par) in enumerate(zip(t.tree_ids[:num_steps], t.tree_parents)):
                if ids is not None:
                    tree_ids[s, : len(ids)] = ids
                    tree_parents[s, : len(par)] = par

        hidden = None
        if self.record_features and t.features:
            n_rows = len(t.request.prompt_ids) + len(output_ids) - 1
            hidden = np.concatenate(t.features, axis=0)[:n_rows]
            if hidden.shape[0] != n_rows:
                hidden = None  # an incomplete history (e.g. features switched on mid-request)

        version = t.versions.most_common(1)[0][0] if t.versions else "none"
        req = t.request
        return TraceRecord(
            request_id=req.request_id,
            tenant=req.tenant,
            domain=req.domain,
            created_at=t.created_at,
            finished_at=time.time(),
            target=self.fingerprint,
            drafter_kind=self._drafter_kind(),
            drafter_version=version,
            temperature=req.params.temperature,
            top_p=req.params.top_p,
            top_k=req.params.top_k,
            finish_reason=finish_reason,
            prompt_ids=np.asarray(req.prompt_ids, dtype=np.int32),
            output_ids=np.asarray(output_ids, dtype=np.int32),
            steps=StepArrays(
                positions=positions[:num_steps],
                num_drafted=num_drafted,
                num_accepted=num_accepted,
                source=np.where(num_drafted > 0, np.asarray(t.source[:num_steps]), 0).astype(
                    np.uint8
                ),
                draft_ids=draft_ids,
                draft_probs=draft_probs,
                target_topk_ids=topk_ids,
                target_topk_logprobs=topk_lp,
                tree_ids=tree_ids,
                tree_parents=tree_parents,
            ),
            hidden_states=hidden,
            hidden_layers=t.feature_layers if hidden is not None else (),
        )
