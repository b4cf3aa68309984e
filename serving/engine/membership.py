"""Rows of TorchEngine's batch: how a request joins (prefill), streams each step's tokens, and
leaves (finished, aborted or failed), with the drafter and the observers told at each of those
points; requests are checked before, by ``generate`` (serving/engine/request_checks.py). Mixed into
TorchEngine (serving/engine/torch_engine.py), whose step thread owns ``_rows``, ``_waiting`` and the
batch cache; ``_forget`` and ``_request_abort`` take its lock."""

from __future__ import annotations

import logging

import numpy as np
import torch

from serving.engine.base import GenerationChunk, RequestError
from serving.engine.batch_cache import RaggedKVCache
from serving.engine.rows import Row
from serving.output import apply_stops

log = logging.getLogger(__name__)


class RowMembership:
    """Requests in and out of the batch (mixed into TorchEngine)."""

    def _forget(self, request_id: str) -> None:
        with self._cv:
            self.admission.release(request_id)

    # ---- joining and leaving --------------------------------------------------------------------------

    def _apply_aborts(self, ids: set[str]) -> None:
        if not ids:
            return
        for sub in [s for s in self._waiting if s.request.request_id in ids]:
            self._waiting.remove(sub)
            self._forget(sub.request.request_id)
            self._outbox.send(
                sub.client,
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
            self._outbox.flush()  # the loop's work runs beside the prefill, not after it
            try:
                row = Row(sub, self.tokenizer, self.eos_ids, self.max_context)
                cache, feats = self._prefill(row.token_ids)
                self._cache.append(cache)
            except Exception as e:
                log.exception("admission failed for %s", sub.request.request_id)
                self._forget(sub.request.request_id)
                self._outbox.send(sub.client, RequestError(f"prefill failed: {e}"))
                continue
            self._rows.append(row)
            if self._drafter is not None and self._drafter.feature_layers:
                row.features, row.features_layers = [feats], self.runner.feature_layers
            self._add_to_drafter(row, feats)
            self._notify_start(row, feats)

    def _drop_rows(self, ids: set[int]) -> None:
        gone = {i for i, r in enumerate(self._rows) if id(r) in ids}
        order = self._cache.drop_rows(gone)  # survivors, reordered: rows follow the cache
        self._rows = [self._rows[i] for i in order]

    def _prefill(self, prompt_ids: list[int]) -> tuple[RaggedKVCache, torch.Tensor | None]:
        """Admission's prefill (model_runner.ModelRunner.prefill); a seam tests and bench swap time."""
        return self.runner.prefill(prompt_ids)

    # ---- each step's tokens, and the end ----

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
            if not self._outbox.send(row.client, row.chunk(emitted, pushed.text, None)):
                self._request_abort(row.request_id)  # the caller's event loop is gone
            return False
        text = pushed.text + row.text.flush()
        self._finish(row, reason, emitted, text)
        return True

    def _finish(self, row: Row, reason: str, tokens: list[int], text: str) -> None:
        self._forget(row.request_id)
        self._outbox.send(row.client, row.chunk(tokens, text, reason))
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
        self._outbox.send(row.client, error)
        if self._drafter is not None and row.draft_ok:
            try:
                self._drafter.remove_request(row.request_id, None)
            except Exception:
                log.exception("drafter.remove_request failed for %s", row.request_id)
        self._notify("on_request_finish", row.request, row.output_ids, "error", row.stats)

    def _notify_start(self, row: Row, feats: torch.Tensor | None) -> None:
        if feats is None:
            self._notify("on_request_start", row.request)
            return
        bits = feats.to(torch.bfloat16).view(torch.int16).cpu().numpy().view(np.uint16)  # [P-1, F]
        self._notify("on_request_start", row.request, bits)
