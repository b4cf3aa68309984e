"""A mistake in what `specloop train` is given is refused before any work, in one line, and loses
nothing: an `--out` that is not a drafter artifact (save_drafter would delete it), zero counts, a
malformed prompt file, a broken `--init`, a missing model, a bad setting, cuda without a GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def wide_terminal_no_device_setting(monkeypatch):
    """Usage errors are a Rich panel: wide enough that no path is folded across its lines. The
    device setting is each test's own."""
    monkeypatch.setenv("COLUMNS", "1000")
    monkeypatch.delenv("SPECLOOP_TRAINER_DEVICE", raising=False)


def invoke(*args: str):
    from infra.cli import app

    return CliRunner().invoke(app, ["train", *args])


def text(result) -> str:
    return " ".join((result.output + (result.stderr or "")).replace("│", " ").split())


def one_line_error(result) -> str:
    """The refusal of a mistake in the input: exit 1, one line on stderr, no traceback."""
    assert isinstance(result.exception, SystemExit), repr(result.exception)  # not an uncaught exception
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    assert "Traceback" not in result.output and result.stdout.strip() == ""
    return lines[0]


@pytest.fixture
def no_training(monkeypatch):
    import trainer.cli

    def refuse(*a, **k):
        raise AssertionError("training started: the bad input was not caught first")

    monkeypatch.setattr(trainer.cli, "run_offline", refuse)


def fail(what: str):
    def refuse(*a, **k):
        raise AssertionError(f"{what} before the input was checked")

    return refuse


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def artifact_meta(kind: str = "standalone", model_id: str = "someone-else") -> str:
    from feedback.registry.artifact import DrafterMeta
    from feedback.target.fingerprint import TargetFingerprint

    fp = TargetFingerprint(model_id=model_id, tokenizer_hash="0" * 16, vocab_size=48)
    return DrafterMeta(kind=kind, version="old", target=fp, config={}, dtype="float32", files={}).model_dump_json()


# --out -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["folder of files", "folder with a garbage config.json", "file",
                                  "the current directory", "under a file"])
def test_an_out_that_is_not_a_drafter_artifact_is_refused_and_left_alone(case, tmp_path, monkeypatch, no_training):
    work = tmp_path / "work"
    (work / "sub").mkdir(parents=True)
    (work / "notes.txt").write_text("keep me")
    (work / "sub" / "data.bin").write_bytes(b"\x00\x01")
    out = work
    if case == "folder with a garbage config.json":
        (work / "config.json").write_text('{"not": "an artifact"}')
    elif case == "file":
        out = work / "notes.txt"
    elif case == "the current directory":
        monkeypatch.chdir(work)
        out = Path(".")
    elif case == "under a file":
        out = work / "notes.txt" / "drafter"
    before = snapshot(work)

    result = invoke("--corpus", "1", "--out", str(out))

    assert result.exit_code == 2, text(result)
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert "--out" in text(result) and str(out) in text(result), text(result)
    assert snapshot(work) == before


@pytest.mark.parametrize("case", ["new", "empty folder", "artifact"])
def test_an_out_that_is_new_empty_or_an_artifact_is_written(case, tmp_path, monkeypatch):
    import trainer.cli

    out = tmp_path / "drafters" / "mine"
    if case != "new":
        out.mkdir(parents=True)
    if case == "artifact":
        (out / "config.json").write_text(artifact_meta())
    seen = []
    monkeypatch.setattr(trainer.cli, "run_offline", lambda model, prompts, out, *a, **k: seen.append(out) or {})

    result = invoke("--corpus", "1", "--out", str(out))

    assert result.exit_code == 0, text(result)
    assert seen == [out]


# counts ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("args", [["--steps", "0"], ["--steps", "-3"], ["--max-new-tokens", "0"]])
def test_a_zero_or_negative_step_or_token_count_is_a_usage_error(args, tmp_path, no_training):
    result = invoke("--requests", "1", "--out", str(tmp_path / "x"), *args)
    assert result.exit_code == 2, text(result)
    assert args[0] in text(result)


# --offline ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad,why", [("{not json", "not JSON"), ('{"text": "hi"}', "'messages' or 'prompt'")])
def test_a_malformed_prompt_file_is_one_line_naming_the_line_before_the_weights_load(bad, why, target_dir,
                                                                                     tmp_path, monkeypatch):
    import transformers

    _, d = target_dir
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):"}\n\n' + bad + "\n")
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fail("the target's weights loaded"))

    line = one_line_error(invoke("--offline", str(prompts), "--model", str(d), "--out", str(tmp_path / "x")))

    assert f"{prompts}:3" in line and why in line, line
    assert not (tmp_path / "x").exists()


# --init ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config,why", [(None, "no config.json"),
                                        ("garbage{", "invalid artifact config"),
                                        ('{"kind": "selfspec"}', "invalid artifact config"),
                                        (artifact_meta("standalone"), "--init needs a selfspec one")])
def test_a_broken_init_artifact_is_refused_before_the_model_loads(config, why, tmp_path, monkeypatch, selfspec_env):
    import feedback.target.location

    init = tmp_path / "pretrained"
    init.mkdir()
    if config is not None:
        (init / "config.json").write_text(config)
    monkeypatch.setattr(feedback.target.location, "model_fingerprint", fail("the model loaded"))

    line = one_line_error(invoke("--requests", "2", "--init", str(init), "--out", str(tmp_path / "x")))

    assert "--init" in line and str(init) in line and why in line, line
    assert not (tmp_path / "x").exists()


def test_an_init_artifact_of_another_target_is_refused_before_its_weights_load(target_dir, tmp_path, monkeypatch,
                                                                               selfspec_env):
    import transformers

    _, d = target_dir
    init = tmp_path / "pretrained"
    init.mkdir()
    (init / "config.json").write_text(artifact_meta("selfspec", model_id="another-model"))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fail("the target's weights loaded"))

    line = one_line_error(invoke("--corpus", "1", "--model", str(d), "--init", str(init),
                                 "--out", str(tmp_path / "x")))

    assert "--init" in line and str(init) in line and "another-model" in line, line


def test_an_init_artifact_is_read_once_and_the_student_starts_from_it(target_dir, tmp_path, monkeypatch,
                                                                      selfspec_env):
    """It was loaded twice: checked before the target's weights, then loaded again for the student."""
    import torch

    import feedback.registry.artifact
    import trainer.corpus
    import trainer.offline
    from feedback.registry.artifact import save_drafter
    from trainer.cli import make_student, run_offline
    from trainer.export import student_draft_vocab

    target, d = target_dir
    pre = make_student(str(d), "selfspec", 64, exit_layer=1, draft_vocab_size=4096)
    with torch.no_grad():
        pre.model.model.layers[1].mlp.up_proj.weight.add_(0.5)  # unlike the day-0 copy of a target layer
    init = tmp_path / "pretrained"
    save_drafter(pre.model, pre.config, target.fingerprint, init, version="pre", draft_vocab=student_draft_vocab(pre))
    loads, real = [], feedback.registry.artifact.load_drafter
    monkeypatch.setattr(feedback.registry.artifact, "load_drafter", lambda *a, **k: loads.append(a[0]) or real(*a, **k))
    students = []  # no traces or training: the student is the point
    monkeypatch.setattr(trainer.corpus, "package_corpus", lambda *a, **k: [])
    monkeypatch.setattr(trainer.offline, "cached_corpus_traces", lambda *a, **k: [])
    monkeypatch.setattr(trainer.offline, "train_offline",
                        lambda student, *a, **k: students.append(student) or {"heldout_acceptance": 0.0})

    result = run_offline(str(d), None, tmp_path / "out", target.model_id, max_new_tokens=8, steps=1, corpus=1,
                         init=init)

    assert loads == [init] and result["init"] == str(init)
    layer = students[0].model.model.layers[1]  # the first adapter layer (exit layer 1)
    assert torch.equal(layer.mlp.up_proj.weight, pre.model.model.layers[1].mlp.up_proj.weight)


# model, settings, device -------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [["--corpus", "1", "--out"], []], ids=["offline", "online"])
def test_a_missing_model_is_one_line(mode, tmp_path):
    out = [str(tmp_path / "x")] if mode else []  # --out is offline's only
    line = one_line_error(invoke(*mode, *out, "--model", str(tmp_path / "no-model")))
    assert "no-model" in line and "no such directory" in line, line


def test_a_bad_setting_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECLOOP_TRAINER_DEVICE", "gpu")
    line = one_line_error(invoke("--corpus", "1", "--out", str(tmp_path / "x")))
    assert "device" in line and "'gpu'" in line, line


@pytest.mark.parametrize("mode", [["--corpus", "1", "--out"], []], ids=["offline", "online"])
def test_cuda_without_a_gpu_is_one_line_before_the_model_loads(mode, tmp_path, monkeypatch):
    import torch

    import feedback.target.location

    monkeypatch.setenv("SPECLOOP_TRAINER_DEVICE", "cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(feedback.target.location, "model_fingerprint", fail("the model loaded"))
    line = one_line_error(invoke(*mode, *([str(tmp_path / "x")] if mode else [])))
    assert "SPECLOOP_TRAINER_DEVICE=cuda" in line and "no CUDA GPU" in line, line


def test_the_command_line_prints_no_traceback_for_a_missing_model(tmp_path):
    done = subprocess.run([sys.executable, "-m", "infra.cli", "train", "--corpus", "1", "--model",
                           str(tmp_path / "no-model"), "--out", str(tmp_path / "x")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr and done.stdout == "", done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"Error: model {str(tmp_path / 'no-model')!r}: no such directory (and not 'SmolLM2-135M-Instruct')")
