"""`specloop suffix-seed --model DIR` writes the seed of that target, and without the option the one
SPECLOOP_MODEL names, read through the settings tree as `specloop serve` reads it (infra/settings.py).
Before, the command had no --model and always answered with the default target, whose seed every
other target's serving refuses."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from feedback.suffix.seed import read_seed


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """A tiny target (the real tokenizer, random weights) saved as a Hugging Face directory."""
    from serving.target import tiny_target

    target = tiny_target(num_layers=2, seed=0)
    d = tmp_path_factory.mktemp("tiny") / "tiny-target"
    target.model.save_pretrained(d)
    target.tokenizer.save_pretrained(d)
    return d


@pytest.fixture
def answers_cache(tmp_path_factory, monkeypatch):
    """The target's answers are cached here, not in the user's cache (shared by this module's tests)."""
    import trainer.cli

    monkeypatch.setattr(trainer.cli, "CORPUS_CACHE", tmp_path_factory.getbasetemp() / "answers")
    monkeypatch.delenv("SPECLOOP_MODEL", raising=False)
    monkeypatch.setenv("COLUMNS", "1000")  # a usage error's panel folds no path


def suffix_seed(*args: str):
    from infra.cli import app

    return CliRunner().invoke(app, ["suffix-seed", "--requests", "1", "--max-new-tokens", "4", *args])


@pytest.mark.usefixtures("answers_cache")
@pytest.mark.parametrize("how", ["--model", "SPECLOOP_MODEL"])
def test_the_seed_is_the_given_targets(how, target_dir, tmp_path, monkeypatch):
    from serving.target import load_target

    out = tmp_path / "seed.json"
    if how == "--model":
        result = suffix_seed("--model", str(target_dir), "--out", str(out))
    else:
        monkeypatch.setenv("SPECLOOP_MODEL", str(target_dir))
        result = suffix_seed("--out", str(out))

    assert result.exit_code == 0, result.output + (result.stderr or "")
    assert result.stdout.strip() == str(out)
    seed = read_seed(out, load_target(str(target_dir)).fingerprint)  # refuses another target's seed
    assert seed.fingerprint.model_id == "tiny-target" and len(seed.sequences) == 2


@pytest.mark.usefixtures("answers_cache")
def test_a_model_that_does_not_exist_is_a_usage_error_naming_the_option(tmp_path):
    result = suffix_seed("--model", str(tmp_path / "nope"), "--out", str(tmp_path / "seed.json"))

    text = " ".join((result.output + (result.stderr or "")).replace("│", " ").split())
    assert result.exit_code == 2 and "--model" in text and "no such directory" in text, text
    assert not (tmp_path / "seed.json").exists()


@pytest.mark.usefixtures("answers_cache")
def test_a_bad_setting_is_a_usage_error_as_serve_says_it(tmp_path, monkeypatch):
    """A bad SPECLOOP_* value ended in pydantic's traceback; `specloop serve` says it in one line
    (feedback/pydantic_errors.py), and now so does suffix-seed, before any model loads."""
    import serving.target

    def refuse(*a, **k):
        raise AssertionError("the target loaded before the settings were checked")

    monkeypatch.setattr(serving.target, "load_target", refuse)
    monkeypatch.setenv("SPECLOOP_K", "abc")

    result = suffix_seed("--out", str(tmp_path / "seed.json"))

    text = " ".join((result.output + (result.stderr or "")).replace("│", " ").split())
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), text
    assert "Invalid value: ServingSettings.k: Input should be a valid integer" in text and "(got 'abc')" in text, text
    assert "Traceback" not in text and "ValidationError" not in text, text
    assert not (tmp_path / "seed.json").exists()
