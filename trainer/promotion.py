"""What a promotion records in MLflow (trainer/loop.py's ``TrainerLoop.promote``): the candidate's
artifact, its run (``candidate-<tenant>-r<round>``: lineage params, the gate's figures, its learning
curves) and the model version registered from it."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from feedback.registry.artifact_keys import (
    EXTRA_CHAMPION_HELDOUT_ACCEPTANCE,
    EXTRA_HELDOUT_ACCEPTANCE,
)
from trainer.gate import GateDecision
from trainer.lineage import replay_params

if TYPE_CHECKING:
    from trainer.loop import TrainerLoop

RUN_NAME_TAG = "mlflow.runName"
"""The tag MLflow names a run by."""


def run_name(tenant: str, round_: int) -> str:
    """A candidate's MLflow run name: its tenant and the trained round it was promoted in."""
    return f"candidate-{tenant}-r{round_}"


def register_candidate(loop: TrainerLoop, d: GateDecision) -> str:
    """Export ``loop.student`` (with the gate's figures and its traces' times, which serving reads
    from the artifact), log its run in ``loop.registry`` and register it as the tenant's next
    version; returns the version. The next version's trace range starts after this one's."""
    extra = {} if d.candidate is None else {EXTRA_HELDOUT_ACCEPTANCE: d.candidate.expected_acceptance}
    if d.candidate is not None and d.champion is not None:  # the same held-out traces
        extra[EXTRA_CHAMPION_HELDOUT_ACCEPTANCE] = d.champion.expected_acceptance
    times = loop.lineage.trace_times()  # serving's freshness of this version starts here
    extra.update(times)
    with tempfile.TemporaryDirectory() as tmp:
        loop.exporter(loop.student, Path(tmp), loop.fingerprint, extra)
        rid = loop.registry.log_candidate(loop.fingerprint, tmp, params=candidate_params(loop),
                                          metrics={**d.as_metrics(), **times}, curves=loop.stats.candidate_curves(),
                                          tags={RUN_NAME_TAG: run_name(loop.cfg.tenant, loop.stats.rounds)})
        version = loop.registry.register(loop.cfg.tenant, rid).version
    loop.lineage.mark()
    return version


def candidate_params(loop: TrainerLoop) -> dict:
    """The candidate run's params: its lineage (trainer/lineage.py) and how it was trained."""
    return loop.lineage.params(
        loop.distiller.cfg, parent_version=loop.champion_version or "none",
        weights_from_version=loop.weights_from_version or "none",
        target_fingerprint=loop.fingerprint.key(), tenant=loop.cfg.tenant, drafter_kind=loop.student.kind,
        train_steps=loop.distiller.global_step, train_precision=loop.distiller.train_precision,
        trace_tokens_seen=loop.replay.tokens_seen, **replay_params(loop.replay))
