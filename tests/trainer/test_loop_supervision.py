"""TrainerLoop.run survives a failing round (MLflow down during a promotion): the error is counted
and logged, training goes on, and the promotion happens once MLflow is back."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import REGISTRY
from trainer_tracegen import FP, make_trace, tiny_lm

from trainer.distill import DistillConfig
from trainer.gate import GateConfig
from trainer.loop import LoopConfig, TrainerLoop
from trainer.sources import ListTraceSource
from trainer.students import StandaloneStudent


class _FlakyRegistry:
    """MLflow that is down for its first ``failures`` calls."""

    def __init__(self, failures: int):
        self.failures, self.registered = failures, []

    def log_candidate(self, fingerprint, path, params, metrics, curves, tags=None):
        if self.failures:
            self.failures -= 1
            raise ConnectionError("MLflow tracking server unreachable")
        return f"run-{len(self.registered)}"

    def register(self, tenant, run_id):
        self.registered.append(run_id)
        return SimpleNamespace(version=str(len(self.registered)))


def _export(student, out, fingerprint, extra):
    (out / "weights").write_bytes(b"x")


def test_a_round_that_raises_does_not_end_training(tmp_path):
    reg = _FlakyRegistry(failures=1)
    src = ListTraceSource([make_trace("a", seed=i) for i in range(120)])
    loop = TrainerLoop(src, StandaloneStudent(tiny_lm(seed=0)), FP,
                       loop=LoopConfig(poll_records=20, min_train_traces=8, steps_per_round=10,
                                       rounds_per_gate=1, checkpoint_dir=str(tmp_path / "ckpt")),
                       distill=DistillConfig(lr=3e-3, eval_every=10),
                       gate=GateConfig(k=3, hybrid=False, acceptance_margin=-1.0, speedup_margin=-10.0),
                       registry=reg, exporter=_export)
    loop.health.backoff.initial_s = 0.01
    before = REGISTRY.get_sample_value("specloop_loop_errors_total", {"loop": loop.health.name}) or 0
    stats = loop.run(max_rounds=4)
    assert stats.round_errors == 1  # the first promotion hit the outage
    assert REGISTRY.get_sample_value("specloop_loop_errors_total", {"loop": loop.health.name}) - before == 1
    assert stats.rounds == 4 and stats.train_steps == 40  # training went on after it
    assert reg.registered and stats.promotions >= 1  # and promoted once MLflow was back
    assert loop.health.up
    assert src.committed == 80  # every trained record committed (the failed round's with the next)
