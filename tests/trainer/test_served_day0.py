"""Compose serves a day-0 standalone draft from /models/draft (SPECLOOP_DRAFTER_DIR); the trainer
read nothing of it, started its student from the target's layers and judged its first candidate
against no drafter at all. It now starts from the served draft, which is its first champion
("day0"), so a candidate must beat what is live; a draft of another shape is refused at start."""

from __future__ import annotations

import pytest
import torch

from feedback.drafters.standalone_lm import standalone_from_target
from trainer.cli import make_student, served_day0_draft
from trainer.config import TrainerSettings


@pytest.fixture(scope="module")
def served_draft_dir(target_dir, tmp_path_factory):
    """A day-0 draft of the student's shape whose weights are not the target's layers."""
    target, _ = target_dir
    draft = standalone_from_target(target.model)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.01 * torch.randn_like(p))
    d = tmp_path_factory.mktemp("served") / "draft"
    draft.save_pretrained(d)
    return draft, d


def test_the_student_starts_as_the_served_draft(target_dir, served_draft_dir):
    _, model_dir = target_dir
    draft, draft_dir = served_draft_dir
    student = make_student(str(model_dir), "standalone", 64, served_day0=str(draft_dir))
    served = dict(draft.state_dict())
    got = dict(student.model.state_dict())
    assert set(got) <= set(served) | {"lm_head.weight"}
    for name, tensor in got.items():
        assert torch.equal(tensor, served.get(name, served["model.embed_tokens.weight"]).float()), name
    fresh = make_student(str(model_dir), "standalone", 64)  # without it: the target's own layers
    assert not torch.equal(fresh.model.model.layers[0].mlp.up_proj.weight,
                           student.model.model.layers[0].mlp.up_proj.weight)


def test_a_served_draft_of_another_shape_is_refused(target_dir, tmp_path):
    target, model_dir = target_dir
    standalone_from_target(target.model, num_layers=3).save_pretrained(tmp_path / "three")
    with pytest.raises(ValueError, match="num_hidden_layers 3 != 2.*refuse every promotion"):
        make_student(str(model_dir), "standalone", 64, served_day0=str(tmp_path / "three"))


def test_the_trainer_reads_the_day0_dir_serving_reads(monkeypatch):
    monkeypatch.setenv("SPECLOOP_DRAFTER_DIR", "/models/draft")
    settings = TrainerSettings()
    assert settings.day0_drafter_dir == "/models/draft" and served_day0_draft(settings) == "/models/draft"
    # an EAGLE head or a selfspec adapter is another kind's weights: those students start from the target
    assert served_day0_draft(settings.model_copy(update={"drafter": "eagle"})) is None
    monkeypatch.delenv("SPECLOOP_DRAFTER_DIR")
    assert served_day0_draft(TrainerSettings()) is None


def test_serving_and_the_trainer_cut_the_same_day0_selfspec_drafter(target_dir):
    """Serving's day-0 selfspec drafter read 16,384 lm_head rows and the trainer's student 8,192,
    so the trainer's first champion was not the drafter serving ran: both now take
    feedback/drafters/defaults.py."""
    from serving.drafters.factory import build_drafter

    target, model_dir = target_dir
    student = make_student(str(model_dir), "selfspec", 64, exit_layer=1)
    served = build_drafter("selfspec", target, exit_layer=1)
    assert torch.equal(served.model.selfspec_draft_vocab, student.head_vocab)
    assert len(student.head_vocab) < target.model.config.vocab_size
