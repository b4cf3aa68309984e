"""Drafter swaps in TorchEngine: install a new drafter between two steps, prepared off the step
thread where the drafter allows it (the "swap preparation" room of the engine).

``DrafterSwaps`` is a mixin of TorchEngine; it relies on the engine's step-thread state (``_rows``,
``_drafter``, ``runner``, ``config``), its condition variable ``_cv`` (snapshots are handed over
between two steps) and ``_notify``. The step thread calls ``_apply_swap`` and ``_serve_snapshots``
between steps; ``swap_drafter`` may be called from any thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time

import torch

from feedback.background.priority import BackgroundWorker
from serving.drafters.base import Drafter, DraftRequestView
from serving.engine.rows import Row

log = logging.getLogger(__name__)

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


class DrafterSwaps:
    """Swapping drafters under a running batch (mixed into TorchEngine)."""

    def _init_swaps(self, drafter: Drafter | None) -> None:
        self._drafter: Drafter | None = drafter
        prior = getattr(drafter, "prior_acceptance", None)
        if prior is not None and hasattr(self.policy, "on_drafter_change"):  # what its artifact measured
            self.policy.on_drafter_change(prior, version=getattr(drafter, "version", None))
        self.runner.feature_layers = self._layers_for(drafter)
        self._pending_swap: _PendingSwap | None = None
        self._swap_lock = threading.Lock()  # _pending_swap, _swap_seq
        self._swap_seq = 0  # swap_drafter calls so far: only the latest one is installed
        self._preparer = BackgroundWorker(
            "specloop-swap-prepare", self.config.swap_prepare_nice, "swap preparer")
        self._snapshot_wanted: list[_SnapshotRequest] = []  # under _cv

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
        done = self._preparer.submit(self._prepare_swap, seq, drafter)
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
        if self.policy is not None and hasattr(self.policy, "on_drafter_change"):
            # acceptance evidence was about the old drafter (a successor starts from it, scaled)
            self.policy.on_drafter_change(getattr(new, "prior_acceptance", None),
                                          version=getattr(new, "version", None),
                                          relative=getattr(new, "prior_relative", None))
        self.runner.feature_layers = self._layers_for(new)
        wants = new is not None and bool(new.feature_layers)
        caught_up = 0
        for row in self._rows:
            if not wants:  # nobody needs the history any more
                row.features, row.features_layers = [], ()
            done = prepared.get(row.request_id, (None, 0))[1]
            if done and self._catch_up(row, done, self.runner.feature_layers if wants else ()):
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
        layers = self.runner.feature_layers
        if row.features_layers == layers and row.features:
            feats = torch.cat(row.features, dim=0)  # [len-1, F]
            if feats.shape[0] == len(row.token_ids) - 1:
                row.features = [feats]
                return feats
        feats = self.runner.recompute_features(row.token_ids[:-1])  # [len-1, F]
        row.features, row.features_layers = [feats], layers
        return feats

    def _announce_drafter(self) -> None:
        d = self._drafter
        self._notify("on_drafter_change", d.kind if d else "none", d.version if d else "none")
