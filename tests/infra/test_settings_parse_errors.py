"""A ``SPECLOOP_*`` value pydantic-settings cannot even parse (a JSON-typed field set to ``[1,``)
is one line naming the variable, from every command that reads the settings tree, before anything
loads. It raises pydantic-settings' SettingsError, not the ValidationError the commands caught, and
reached the user as a traceback (feedback/pydantic_errors.py ``first_settings_error``)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

VARIABLE, VALUE = "SPECLOOP_SGLANG_SERVER_ARGS", "[1,"
COMMANDS = {  # command line, exit code: a usage error (2), or train's one-line refusal (1)
    "serve": (["serve"], 2),
    "generate": (["generate", "hi"], 2),
    "suffix-seed": (["suffix-seed"], 2),
    "demo": (["demo"], 2),
    "bench online": (["bench", "online", "--no-verbose"], 2),
    "train": (["train"], 1),
}


@pytest.fixture
def nothing_loads(monkeypatch):
    """A command that gets past its settings fails the test loudly: no model, engine or stack."""
    import infra.root
    import serving.builder
    import serving.target

    def refuse(*a, **k):
        raise AssertionError("it got past the settings: the bad value was not caught first")

    monkeypatch.setattr(serving.target, "load_target", refuse)
    monkeypatch.setattr(serving.builder, "build_engine", refuse)
    monkeypatch.setattr(infra.root, "build_stack", refuse)
    monkeypatch.setenv("COLUMNS", "1000")  # the usage panel folds no value across its lines


@pytest.mark.usefixtures("nothing_loads")
@pytest.mark.parametrize("command", COMMANDS)
def test_an_unparsable_setting_is_one_line_naming_the_variable(command, monkeypatch, tmp_path):
    from infra.cli import app

    args, code = COMMANDS[command]
    if command == "demo":
        args = [*args, "--run-dir", str(tmp_path / "run")]
    monkeypatch.setenv(VARIABLE, VALUE)
    out = CliRunner().invoke(app, args)
    text = " ".join((out.output + (out.stderr or "")).replace("│", " ").split())
    assert out.exit_code == code and isinstance(out.exception, SystemExit), (out.exception, text)
    assert f"{VARIABLE}: could not be parsed: Expecting value" in text and f"(got '{VALUE}')" in text, text
    assert "Traceback" not in text and "SettingsError" not in text, text
    assert not (tmp_path / "run").exists()  # the demo's run directory: nothing started
