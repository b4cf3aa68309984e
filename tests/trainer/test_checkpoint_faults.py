"""Fault injection: the trainer is killed between every pair of checkpoint steps (and between the
checkpoint and the offset commit); it resumes with nothing lost and at most one poll's batch trained
twice, and ends exactly where an uninterrupted trainer ends."""

from __future__ import annotations

import pytest
import torch
from trainer_tracegen import FP, make_trace, tiny_lm

from trainer import checkpoint
from trainer.distill import DistillConfig
from trainer.gate import GateConfig
from trainer.loop import LoopConfig, TrainerLoop
from trainer.sources import ListTraceSource
from trainer.students import StandaloneStudent

POLL, STEPS, N = 20, 4, 60


class Killed(BaseException):
    """Stands for SIGKILL: nothing after it runs (BaseException, so no handler catches it)."""


def _loop(source, root):
    return TrainerLoop(
        source, StandaloneStudent(tiny_lm(seed=0)), FP,
        loop=LoopConfig(poll_records=POLL, min_train_traces=8, steps_per_round=STEPS, rounds_per_gate=100,
                        checkpoint_dir=str(root), checkpoint_keep=2),
        distill=DistillConfig(lr=3e-3, eval_every=STEPS), gate=GateConfig(k=3, hybrid=False))


def _ids(loop):
    return {r.request_id for r in loop.replay.train_records} | {r.request_id for r in loop.replay.heldout}


def _drain(loop, src):
    while src._pending:
        loop.run_round()


@pytest.fixture(scope="module")
def records():
    return [make_trace("a", seed=i) for i in range(N)]


@pytest.fixture(scope="module")
def reference(records, tmp_path_factory):
    """The uninterrupted run: its final weights and step."""
    src = ListTraceSource(records)
    loop = _loop(src, tmp_path_factory.mktemp("ref"))
    _drain(loop, src)
    return loop.distiller.global_step, [p.detach().clone() for p in loop.student.model.parameters()]


@pytest.mark.parametrize("kill_at", [*checkpoint.STEPS, "commit"])
def test_killed_between_checkpoint_steps_resumes_with_nothing_lost(kill_at, records, reference, tmp_path):
    src = ListTraceSource(records)
    loop = _loop(src, tmp_path)
    loop.run_round()  # round 1: checkpointed and committed
    step_before = loop.distiller.global_step

    def fault(step):
        if step == kill_at:
            raise Killed(step)

    if kill_at == "commit":
        def killed_commit():
            raise Killed("commit")
        src_commit, src.commit = src.commit, killed_commit
    else:
        loop.checkpoint_fault = fault
    with pytest.raises(Killed):
        loop.run_round()  # round 2 dies
    if kill_at == "commit":
        src.commit = src_commit
    redelivered = len(src._uncommitted)
    src.rewind()  # the broker hands uncommitted records out again

    resumed = _loop(src, tmp_path)
    durable = checkpoint.STEPS.index("rename") if kill_at != "commit" else len(checkpoint.STEPS)
    renamed = kill_at == "commit" or checkpoint.STEPS.index(kill_at) >= durable
    # the checkpoint is the previous one or the new one, never neither
    assert resumed.distiller.global_step == (step_before + STEPS if renamed else step_before)
    assert redelivered <= POLL  # at most one poll's batch comes back (and is trained again)
    _drain(resumed, src)
    assert _ids(resumed) == {r.request_id for r in records}  # nothing lost
    # a batch already in the new checkpoint is recognised, not trained twice as new data
    assert resumed.replay.rejected["duplicate"] == (redelivered if renamed else 0)
    step, params = reference
    assert resumed.distiller.global_step == step
    for a, b in zip(params, resumed.student.model.parameters()):
        assert torch.equal(a, b)
    assert [p.name for p in tmp_path.iterdir()] == [resumed.checkpoint_root.name]  # this identity's only
    left = sorted(p.name for p in resumed.checkpoint_root.iterdir())
    assert len(left) <= 2 and all(n.startswith("ckpt-") for n in left), left  # kept 2 deep, no temp


def test_a_checkpoint_that_does_not_load_falls_back_to_the_previous_one(records, tmp_path):
    src = ListTraceSource(records)
    loop = _loop(src, tmp_path)
    loop.run_round()
    first = loop.distiller.global_step
    loop.run_round()
    (checkpoint.latest(loop.checkpoint_root) / "distiller.pt").write_bytes(b"torn")
    resumed = _loop(src, tmp_path)
    assert resumed.distiller.global_step == first
