"""`specloop train --init ARTIFACT` without an offline mode: the online trainer's student starts from
the artifact (read in the Ray worker, checked against the target before Ray starts), and when
serving starts with that same artifact (SPECLOOP_DRAFTER_DIR) it is the first champion, which
candidates must beat. Before, the option was silently ignored online: the student started from the
day-0 copy of a target layer."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner


class Started(Exception):
    """Raised where Ray would start: what the actor was given is recorded."""


@pytest.fixture
def pretrained(target_dir, tmp_path):
    """A selfspec artifact for the tiny target, unlike the day-0 student; and the student it holds."""
    from feedback.registry.artifact import save_drafter
    from feedback.target.location import model_fingerprint
    from trainer.cli import make_student
    from trainer.export import student_draft_vocab

    _, d = target_dir
    pre = make_student(str(d), "selfspec", 64, exit_layer=1, draft_vocab_size=4096)
    with torch.no_grad():
        pre.model.model.layers[1].mlp.up_proj.weight.add_(0.5)
    init = tmp_path / "pretrained"
    fingerprint = model_fingerprint(str(d))[1]  # what `specloop train --model DIR` trains for
    save_drafter(pre.model, pre.config, fingerprint, init, version="pre", draft_vocab=student_draft_vocab(pre))
    return init, pre


@pytest.fixture
def actor(monkeypatch):
    """``start_actor``'s arguments, recorded instead of starting Ray."""
    import trainer.actor

    seen = {}

    def start(settings, factory, fingerprint, **kw):
        seen.update(factory=factory, **kw)
        raise Started

    monkeypatch.setattr(trainer.actor, "start_actor", start)
    monkeypatch.delenv("SPECLOOP_DRAFTER_DIR", raising=False)
    monkeypatch.delenv("SPECLOOP_TRAINER_DAY0_DRAFTER_DIR", raising=False)
    monkeypatch.setenv("COLUMNS", "1000")
    return seen


def train(*args: str):
    from infra.cli import app

    return CliRunner().invoke(app, ["train", *args])


@pytest.mark.usefixtures("selfspec_env")
@pytest.mark.parametrize("served", [False, True], ids=["serving-runs-another", "serving-runs-it"])
def test_the_online_student_starts_from_the_init_artifact(served, target_dir, pretrained, actor, monkeypatch):
    _, d = target_dir
    init, pre = pretrained
    if served:
        monkeypatch.setenv("SPECLOOP_DRAFTER_DIR", str(init))

    result = train("--model", str(d), "--init", str(init))

    assert isinstance(result.exception, Started), result.output + (result.stderr or "")
    assert actor["initial_champion"] == ("pre" if served else None)
    student = actor["factory"]()  # what the Ray worker runs
    layer = student.model.model.layers[1]  # the first adapter layer (exit layer 1)
    assert torch.equal(layer.mlp.up_proj.weight, pre.model.model.layers[1].mlp.up_proj.weight)


def test_init_for_another_drafter_kind_is_a_usage_error_online(pretrained, actor, monkeypatch):
    monkeypatch.setenv("SPECLOOP_TRAINER_DRAFTER", "standalone")
    init, _ = pretrained

    result = train("--init", str(init))

    text = " ".join((result.output + (result.stderr or "")).replace("│", " ").split())
    assert result.exit_code == 2 and "--init starts a selfspec drafter, not standalone" in text, text
    assert actor == {}


@pytest.mark.usefixtures("selfspec_env")
def test_init_of_another_target_is_one_line_before_ray_starts(target_dir, tmp_path, actor):
    from feedback.registry.artifact import DrafterMeta
    from feedback.target.fingerprint import TargetFingerprint

    _, d = target_dir
    init = tmp_path / "other"
    init.mkdir()
    fp = TargetFingerprint(model_id="another-model", tokenizer_hash="0" * 16, vocab_size=48)
    (init / "config.json").write_text(DrafterMeta(kind="selfspec", version="v", target=fp, config={},
                                                  dtype="float32", files={}).model_dump_json())

    result = train("--model", str(d), "--init", str(init))

    assert result.exit_code == 1 and actor == {}, result.output
    line = result.stderr.strip()
    assert line.startswith("Error: ") and "--init" in line and "another-model" in line, line


@pytest.mark.usefixtures("selfspec_env")
@pytest.mark.parametrize("case", ["serving-runs-init", "serving-runs-another", "no-init"])
def test_the_day0_log_line_says_where_the_student_starts(case, target_dir, pretrained, actor, tmp_path, monkeypatch,
                                                         caplog):
    """With SPECLOOP_DRAFTER_DIR the same directory as --init, the log said the selfspec student
    "starts from the target, not from it": it starts from that very artifact."""
    import logging

    _, d = target_dir
    init, _ = pretrained
    other = tmp_path / "served-elsewhere"
    other.mkdir()
    monkeypatch.setenv("SPECLOOP_DRAFTER_DIR", str(init if case == "serving-runs-init" else other))
    caplog.set_level(logging.INFO, logger="trainer.cli")

    result = train("--model", str(d), *(["--init", str(init)] if case != "no-init" else []))

    assert isinstance(result.exception, Started), result.output + (result.stderr or "")
    lines = [r.getMessage() for r in caplog.records if r.name == "trainer.cli" and "day-0 drafter" in r.message]
    assert len(lines) == 1, caplog.text
    expected = {"serving-runs-init": f"day-0 drafter {init}: the selfspec student starts from it (--init)",
                "serving-runs-another": f"day-0 drafter {other}: a selfspec student starts from --init {init}, "
                                        "not from it",
                "no-init": f"day-0 drafter {other}: a selfspec student starts from the target, not from it"}
    assert lines[0] == expected[case]
