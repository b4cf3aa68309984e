"""A candidate's lineage: the MLflow params the trainer logs with each candidate drafter.

Beside the static params (topic, group, ...) and the distillation settings, a version records:

- ``trace_offsets``: partition -> (first, last) offset of the traces consumed since the previous
  registration (sources without offsets record none): the traffic that is new to this version, not
  all it was trained on. Training samples the whole replay buffer, recency-weighted, so a version
  also learned from traces of earlier ranges still in the replay; ``replay_traces`` and
  ``replay_oldest_trace_at`` (``replay_params``) say how many and how far back. When the new traces'
  requests finished (``trace_times``) is what serving measures a version's freshness from when it
  swaps the version in. Offsets and times survive a restart through the checkpoint (``restore``).
- ``parent_version``: the champion it had to beat (``none``: no champion, only the suffix index),
  and ``weights_from_version``: the last version promoted in this student's line, the weights its
  training went on from (``none``: none promoted, it descends from the student's first weights).
  They differ after a rollback: the champion goes back with serving, but the student trains on
  from the rolled-back weights.
"""

from __future__ import annotations

import json
import statistics

from feedback.registry.artifact_keys import (
    EXTRA_TRACE_FINISHED_MEDIAN_AT,
    EXTRA_TRACE_FINISHED_NEWEST_AT,
    EXTRA_WINDOW_TRACES,
)

_TIMES_KEPT = 10_000


def loss_params(cfg) -> dict:
    """The distillation loss settings of ``cfg`` (a DistillConfig)."""
    return {"loss": cfg.loss, "discard_weight": cfg.discard_weight, "reject_weight": cfg.reject_weight,
            "ce_weight": cfg.ce_weight, "lr": cfg.lr, "weight_decay": cfg.weight_decay}


def replay_params(replay) -> dict:
    """``replay_traces``: the training traces in ``replay`` (a ReplayBuffer), which training samples
    from; ``replay_oldest_trace_at``: when the oldest of their requests finished (epoch s)."""
    records = replay.train_records
    out: dict = {"replay_traces": len(records)}
    if records:
        out["replay_oldest_trace_at"] = min(float(r.finished_at) for r in records)
    return out


class Lineage:
    def __init__(self, source, static: dict):
        """``source``: the trace source (its ``lineage_window`` and ``mark_lineage``, when it has
        offsets); ``static``: params logged with every candidate (LoopConfig.lineage)."""
        self.source = source
        self.static = static
        self.restored: dict[int, tuple[int, int]] = {}
        """Offsets consumed since the last registration, as checkpointed before a restart."""
        self.finished_at: list[float] = []
        """When the requests of the traces taken in since the last registration finished (epoch
        s; the latest ``_TIMES_KEPT``)."""

    def note_traces(self, records) -> None:
        """Traces the trainer took in (TraceRecords): the next version is the first trained on them."""
        self.finished_at.extend(float(r.finished_at) for r in records)
        del self.finished_at[:-_TIMES_KEPT]

    def trace_times(self) -> dict[str, float]:
        """``window_traces``, ``trace_finished_median_at`` and ``trace_finished_newest_at`` (epoch
        s) of the traces taken in since the last registration; {} when there were none."""
        if not self.finished_at:
            return {}
        return {EXTRA_WINDOW_TRACES: float(len(self.finished_at)),
                EXTRA_TRACE_FINISHED_MEDIAN_AT: statistics.median(self.finished_at),
                EXTRA_TRACE_FINISHED_NEWEST_AT: max(self.finished_at)}

    def window(self) -> dict[int, tuple[int, int]] | None:
        """Partition -> (first, last) offset of every trace consumed since the previous registration
        (None for sources without offsets)."""
        window = getattr(self.source, "lineage_window", None)
        if window is None:
            return None
        from feedback.bus.kafka_source import merge_windows

        return merge_windows(self.restored, window)

    def offset_params(self) -> dict:
        """``trace_offsets`` (readable) and ``trace_offsets_json`` of ``window()``; none without offsets."""
        window = self.window()
        if window is None:
            return {}
        from feedback.bus.kafka_source import format_window

        topic = getattr(getattr(self.source, "settings", None), "topic", self.static.get("topic", "traces"))
        return {"trace_offsets": format_window(topic, window),
                "trace_offsets_json": json.dumps({str(p): list(r) for p, r in window.items()})}

    def params(self, distill_cfg, **figures) -> dict:
        """Everything logged with a candidate: the static params, ``distill_cfg``'s loss settings, the
        caller's ``figures`` (parent version, steps, ...) and the trace offsets."""
        return {**self.static, **loss_params(distill_cfg), **figures, **self.offset_params()}

    def mark(self) -> None:
        """A version was registered: the next one's trace range starts after this one's."""
        self.restored = {}
        self.finished_at = []
        mark = getattr(self.source, "mark_lineage", None)
        if mark is not None:
            mark()

    def restore(self, saved: dict | None, finished_at: list[float] | None = None) -> None:
        """The window and trace times as checkpointed (JSON: partition keys are strings, ranges
        lists)."""
        self.restored = {int(p): tuple(r) for p, r in (saved or {}).items()}
        self.finished_at = [float(t) for t in finished_at or []][-_TIMES_KEPT:]
