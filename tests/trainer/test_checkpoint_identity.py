"""Checkpoints are kept per trainer identity (tenant, drafter kind, target): trainers of another
identity sharing ``checkpoint_dir`` neither load nor prune each other's checkpoints, a restart with
the same settings resumes from its own latest one, and a checkpoint recording another identity is
never loaded (trainer/checkpoint.py)."""

from __future__ import annotations

import shutil

import pytest
import torch
from trainer_tracegen import FP, make_trace, tiny_lm

from trainer import checkpoint
from trainer.distill import DistillConfig
from trainer.gate import GateConfig
from trainer.loop import LoopConfig, TrainerLoop
from trainer.replay import ReplayBuffer
from trainer.sources import ListTraceSource
from trainer.students import StandaloneStudent

POLL, STEPS, KEEP, ROUNDS = 20, 2, 2, 3
"""Each trainer saves ROUNDS checkpoints, more than the KEEP it prunes to."""


class _OtherKind(StandaloneStudent):
    """The tiny standalone student under another drafter kind's label: the layout keys on the kind."""

    kind = "eagle"


def _loop(root, tenant="default", student_cls=StandaloneStudent, seed=0):
    src = ListTraceSource([make_trace("a", seed=seed + i, tenant=tenant) for i in range(POLL * ROUNDS)])
    return TrainerLoop(
        src, student_cls(tiny_lm(seed=0)), FP,
        loop=LoopConfig(tenant=tenant, poll_records=POLL, min_train_traces=8, steps_per_round=STEPS,
                        rounds_per_gate=100, checkpoint_dir=str(root), checkpoint_keep=KEEP),
        distill=DistillConfig(lr=3e-3, eval_every=STEPS), gate=GateConfig(k=3, hybrid=False))


def _train(loop):
    for _ in range(ROUNDS):
        loop.run_round()
    assert loop.distiller.global_step == ROUNDS * STEPS
    return loop


def _on_disk(root) -> dict[str, bytes]:
    """Every checkpoint anywhere under ``root``: its path -> its meta.json."""
    return {str(m.parent): m.read_bytes() for m in root.rglob("ckpt-*/meta.json")}


def _ids(loop):
    return {r.request_id for r in loop.replay.train_records} | {r.request_id for r in loop.replay.heldout}


def _same_state(a, b):
    assert a.distiller.global_step == b.distiller.global_step
    assert _ids(a) == _ids(b)
    for x, y in zip(a.student.model.parameters(), b.student.model.parameters()):
        assert torch.equal(x, y)


OTHERS = {"tenant": {"tenant": "beta"}, "kind": {"student_cls": _OtherKind}}


@pytest.mark.parametrize("other", sorted(OTHERS))
def test_trainers_of_another_identity_sharing_the_dir_keep_each_others_checkpoints(other, tmp_path):
    a = _train(_loop(tmp_path))
    a_saved = _on_disk(tmp_path)
    assert len(a_saved) == KEEP

    b = _loop(tmp_path, seed=1000, **OTHERS[other])
    assert b.distiller.global_step == 0 and len(b.replay) == 0  # nothing of a's loaded
    _train(b)  # more saves than the prune limit
    after = _on_disk(tmp_path)
    assert {p: after.get(p) for p in a_saved} == a_saved  # a's checkpoints untouched
    assert len(after) == 2 * KEEP  # b kept its own newest KEEP beside them

    _same_state(_loop(tmp_path), a)  # each restart resumes from its own latest
    _same_state(_loop(tmp_path, seed=1000, **OTHERS[other]), b)


def test_a_restart_with_the_same_identity_resumes_from_its_latest_checkpoint(tmp_path):
    a = _loop(tmp_path, tenant="acme")
    a.run_round()
    a.run_round()
    resumed = _loop(tmp_path, tenant="acme")
    _same_state(resumed, a)
    assert resumed.checkpoint_root == a.checkpoint_root
    assert resumed.checkpoint_root.parent == tmp_path
    assert checkpoint.recorded_identity(checkpoint.latest(resumed.checkpoint_root)) == a.checkpoint_identity


def test_a_checkpoint_recording_another_identity_is_never_loaded_nor_pruned(tmp_path, caplog):
    a = _loop(tmp_path / "a")
    a.run_round()
    b = _loop(tmp_path / "b", tenant="beta")  # its root, where a's checkpoint is put by hand
    foreign = b.checkpoint_root / "ckpt-00000001"
    shutil.copytree(checkpoint.latest(a.checkpoint_root), foreign)
    assert checkpoint.recorded_identity(foreign) == a.checkpoint_identity != b.checkpoint_identity

    with caplog.at_level("ERROR", logger="trainer.checkpoint"):
        b = _loop(tmp_path / "b", tenant="beta", seed=1000)
    assert b.distiller.global_step == 0 and len(b.replay) == 0 and b.champion_version is None
    assert "not loaded" in caplog.text
    with pytest.raises(checkpoint.ForeignCheckpoint):
        checkpoint.load(foreign, b.distiller, ReplayBuffer(), b.checkpoint_identity)

    _train(b)
    assert foreign.exists()  # never pruned by b's saves
    assert len(checkpoint.all_checkpoints(b.checkpoint_root)) == KEEP + 1
    _same_state(_loop(tmp_path / "b", tenant="beta", seed=1000), b)


def test_checkpoints_of_the_earlier_layout_are_neither_loaded_nor_deleted(tmp_path):
    """Numbered checkpoints directly in checkpoint_dir (no identity recorded) are ignored."""
    old = _loop(tmp_path / "unused")
    old.cfg.checkpoint_dir = None  # trained without checkpoints, then saved the earlier way:
    old.run_round()
    checkpoint.save(tmp_path, old.distiller, old.replay, {"champion_version": "7"})  # ckpt-00000001
    legacy = _on_disk(tmp_path)
    assert list(legacy) == [str(tmp_path / "ckpt-00000001")]
    assert b'"identity"' not in legacy[str(tmp_path / "ckpt-00000001")]  # it recorded none

    loop = _loop(tmp_path)
    assert loop.distiller.global_step == 0 and len(loop.replay) == 0 and loop.champion_version is None
    _train(loop)
    assert {p: v for p, v in _on_disk(tmp_path).items() if p in legacy} == legacy


def test_identity_roots_are_deterministic_distinct_and_filesystem_safe(tmp_path):
    other_target = FP.model_copy(update={"model_id": "org/Some Model:v2", "tokenizer_hash": "f" * 16})
    idents = [checkpoint.identity(t, k, fp) for t in ("default", "a/b", "a_b", "../x")
              for k in ("standalone", "eagle") for fp in (FP, other_target)]
    names = [checkpoint.identity_dirname(i) for i in idents]
    assert len(set(names)) == len(names)
    assert names == [checkpoint.identity_dirname(dict(i)) for i in idents]  # same settings, same place
    for name in names:
        assert len(name) <= 120 and "/" not in name and not name.startswith(".")
    assert checkpoint.identity_root(tmp_path, checkpoint.identity("a/b", "eagle", FP)).parent == tmp_path
