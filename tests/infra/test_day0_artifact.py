"""A pre-trained selfspec artifact as the loop's start (``LoopConfig.day0_artifact``): serving
drafts with it from the first request, the trainer starts from it and must beat it to promote."""

import torch

from infra.day0 import day0_drafter, learned_kind, make_selfspec_student
from infra.loop import LoopConfig
from serving.target import tiny_target
from trainer.export import artifact_exporter
from trainer.gate import GateConfig
from trainer.loop import TrainerLoop
from trainer.sources import ListTraceSource


def _pretrained(tmp_path):
    target = tiny_target(vocab_size=300, hidden_size=64, num_layers=4)
    student = make_selfspec_student(target, draft_vocab_size=128, exit_layer=1)
    with torch.no_grad():  # stands for training: an adapter no day-0 copy of a target layer equals
        student.model.model.layers[1].mlp.up_proj.weight.add_(0.25)
    artifact_exporter(student.config, version_prefix="pretrained")(student, tmp_path / "pre", target.fingerprint)
    return target, student, tmp_path / "pre"


def test_serving_drafts_with_the_artifact_from_the_first_request(tmp_path):
    target, student, pre = _pretrained(tmp_path)
    assert learned_kind(LoopConfig(day0_artifact=str(pre))) == "selfspec"
    hybrid = day0_drafter("hybrid", target, 128, artifact=str(pre))
    learned = hybrid.learned  # the hybrid has its learned half from day 0, not only after a promotion
    assert learned.version == "pretrained-1"
    weight = learned.model.model.layers[1].mlp.up_proj.weight
    assert torch.equal(weight.float(), student.model.model.layers[1].mlp.up_proj.weight)
    alone = day0_drafter("standalone", target, 128, artifact=str(pre))
    assert alone.version == "pretrained-1"


def test_trainer_starts_from_the_artifact_and_must_beat_it(tmp_path):
    target, student, pre = _pretrained(tmp_path)
    again = make_selfspec_student(target, 128, exit_layer=1, artifact=str(pre))
    for a, b in zip(again.model.model.layers[1].parameters(), student.model.model.layers[1].parameters()):
        assert torch.equal(a, b)
    loop = TrainerLoop(ListTraceSource([]), again, target.fingerprint, gate=GateConfig(k=3, hybrid=False),
                       initial_champion="pretrained-1")
    assert loop.champion_version == "pretrained-1" and loop.champion is not None
    assert loop.champion.model is not loop.student.model  # a frozen copy, not the training weights
