"""What operators read about a round and a candidate describes the weights it is about: a round's
held-out acceptance is that of the weights the round kept (``fit`` restores its best, not its
last), a candidate run's curves hold one point per step and only the losses since the previous
promotion, and its lineage names the weights it descends from beside the champion it had to beat,
which differ after a rollback."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from trainer_tracegen import FP, make_trace, tiny_lm

from feedback.control.plane import RollbackAnnouncement
from trainer.distill import DistillConfig
from trainer.gate import GateConfig
from trainer.loop import LoopConfig, TrainerLoop
from trainer.sources import ListTraceSource
from trainer.students import StandaloneStudent


class _Ops:
    """The loop's ops log, recording the metrics it is given."""

    def __init__(self):
        self.logged: list[dict] = []

    def metrics(self, values, step=0):
        self.logged.append(dict(values))

    def __getattr__(self, name):
        return lambda *a, **k: None


class _Registry:
    """MLflow as the loop calls it: each candidate's params, curves and tags; version n is run n."""

    def __init__(self):
        self.runs: list[dict] = []

    def log_candidate(self, fingerprint, path, params, metrics, curves, tags=None):
        self.runs.append({"params": params, "curves": curves, "tags": tags})
        return str(len(self.runs))

    def register(self, tenant, run_id):
        return SimpleNamespace(version=run_id)


def _export(student, out, fingerprint, extra):
    (out / "weights").write_bytes(b"x")


def _traces(n: int) -> list:
    return [make_trace("a", seed=i, tenant="acme").model_copy(update={"finished_at": 1000.0 + i})
            for i in range(n)]


def _promoting_loop(records, checkpoint_dir=None, **kw) -> TrainerLoop:
    """Gates every round and promotes whatever a round changed (margins far below any candidate)."""
    return TrainerLoop(ListTraceSource(records), StandaloneStudent(tiny_lm(seed=0)), FP,
                       loop=LoopConfig(tenant="acme", poll_records=20, min_train_traces=8, steps_per_round=6,
                                       rounds_per_gate=1, checkpoint_dir=checkpoint_dir),
                       distill=DistillConfig(lr=3e-3, eval_every=2),
                       gate=GateConfig(k=3, hybrid=False, acceptance_margin=-1.0, speedup_margin=-10.0),
                       exporter=_export, **kw)


def _kept_acceptance(loop: TrainerLoop) -> float:
    """Held-out expected acceptance of the student's weights as they are now."""
    return loop.distiller.evaluate(loop.replay.heldout, 3)["expected_acceptance"]


def test_each_rounds_heldout_acceptance_is_that_of_the_weights_the_round_kept():
    ops = _Ops()
    loop = TrainerLoop(ListTraceSource([make_trace("a", seed=i) for i in range(100)]),
                       StandaloneStudent(tiny_lm(seed=0)), FP,
                       loop=LoopConfig(poll_records=20, min_train_traces=8, steps_per_round=5, rounds_per_gate=1000),
                       distill=DistillConfig(lr=0.5, eval_every=5),  # a rate at which evaluations go down
                       gate=GateConfig(k=3, hybrid=False), ops=ops)
    fits = []
    fit = loop.distiller.fit
    loop.distiller.fit = lambda *a, **k: fits.append(fit(*a, **k)) or fits[-1]
    for _ in range(4):
        loop.run_round()
        round_metrics = [m for m in ops.logged if "records_polled" in m][-1]
        assert round_metrics["heldout_expected_acceptance"] == pytest.approx(_kept_acceptance(loop), abs=1e-9)
        assert loop.stats.heldout_acceptance == round_metrics["heldout_expected_acceptance"]  # demo, summary.json
        assert loop.stats.heldout_acceptance == fits[-1].best_acceptance
    assert len(fits) == 4 and len(loop.stats.curve) == 4  # one point per round
    # what this is about happened: a round whose last evaluation was below the weights it kept
    assert any(r.curve[-1]["expected_acceptance"] < r.best_acceptance for r in fits)


def test_a_candidates_curves_hold_one_point_per_step_and_the_losses_since_the_previous_promotion():
    reg = _Registry()
    loop = _promoting_loop(_traces(100), registry=reg)
    kept: dict[int, float] = {}  # tokens seen at each round -> the acceptance of the weights it kept
    promoted = []  # (rounds, global step) at each registration
    for _ in range(5):
        loop.run_round()
        kept[loop.replay.tokens_seen] = _kept_acceptance(loop)
        if len(reg.runs) > len(promoted):
            promoted.append((loop.stats.rounds, loop.distiller.global_step))
    assert len(reg.runs) >= 2, loop.stats.last_decision
    previous_step = 0
    for run, (rounds, step) in zip(reg.runs, promoted):
        acceptance = run["curves"]["heldout_expected_acceptance"]
        # one point per step (tokens seen), the kept weights' of each round so far: fit evaluates
        # several times a round at the same step, and keeps its best
        assert [s for s, _ in acceptance] == list(kept)[:rounds]
        assert [v for _, v in acceptance] == pytest.approx([kept[s] for s, _ in acceptance], abs=1e-9)
        # the losses of the steps since the previous promotion, at their global steps
        assert run["curves"]["train_loss"] == list(enumerate(loop.stats.losses[previous_step:step], previous_step))
        assert run["tags"] == {"mlflow.runName": f"candidate-acme-r{rounds}"}
        previous_step = step


def test_after_a_rollback_a_candidate_names_the_weights_it_descends_from_beside_the_champion_it_beat(tmp_path):
    reg = _Registry()
    loop = _promoting_loop(_traces(200), registry=reg, checkpoint_dir=str(tmp_path / "ckpt"))

    def next_candidate() -> dict:
        runs = len(reg.runs)
        for _ in range(10):
            loop.run_round()
            if len(reg.runs) > runs:
                return reg.runs[-1]["params"]
        raise AssertionError(f"no promotion: {loop.stats.last_decision}")

    def rollback(from_version: str, to_version: str) -> None:
        loop.on_rollback(RollbackAnnouncement(tenant="acme", from_version=from_version, to_version=to_version,
                                              reason="live acceptance fell"))

    first = next_candidate()
    assert (first["parent_version"], first["weights_from_version"]) == ("none", "none")
    rollback("1", "day0")
    loop.apply_rollbacks()  # the champion is gone with serving's; the student trains on from "1"
    loop.save()
    restarted = _promoting_loop([], registry=reg, checkpoint_dir=str(tmp_path / "ckpt"))
    assert (restarted.champion_version, restarted.weights_from_version) == (None, "1")  # a restart keeps both
    second = next_candidate()
    assert (second["parent_version"], second["weights_from_version"]) == ("none", "1")
    third = next_candidate()
    assert (third["parent_version"], third["weights_from_version"]) == ("2", "2")
    rollback("3", "2")  # back to a version the trainer holds
    fourth = next_candidate()
    assert (fourth["parent_version"], fourth["weights_from_version"]) == ("2", "3")
    # what training sampled from when it was registered: the whole replay, not the new traces alone
    assert fourth["replay_traces"] == len(loop.replay)
    assert fourth["replay_oldest_trace_at"] == min(r.finished_at for r in loop.replay.train_records) < 1020.0
