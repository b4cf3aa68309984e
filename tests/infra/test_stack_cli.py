"""`specloop stack up --storage`: the option wins when given, else $SPECLOOP_STACK_STORAGE does."""

from __future__ import annotations

from typer.testing import CliRunner

from infra.stack_cli import stack_settings


def test_storage_comes_from_the_environment_unless_the_option_is_given(monkeypatch):
    monkeypatch.delenv("SPECLOOP_STACK_STORAGE", raising=False)
    assert stack_settings(None).storage == "memory"
    monkeypatch.setenv("SPECLOOP_STACK_STORAGE", "s3")
    assert stack_settings(None).storage == "s3"  # `stack up` without --storage
    assert stack_settings("memory").storage == "memory"  # `stack up --storage memory`


def test_an_unknown_storage_is_refused_before_anything_starts(tmp_path):
    from infra.cli import app

    out = CliRunner().invoke(app, ["stack", "up", "--storage", "disk", "--run-dir", str(tmp_path)])
    assert out.exit_code == 2 and "storage 'disk'" in out.output, out.output
    assert not (tmp_path / "stack.json").exists()


def test_status_of_a_missing_stack_says_so_and_fails_without_creating_it(tmp_path):
    from infra.cli import app

    run_dir = tmp_path / "typo" / "stack"
    out = CliRunner().invoke(app, ["stack", "status", "--run-dir", str(run_dir)])
    text = out.output + (out.stderr or "")
    assert out.exit_code == 1 and f"no stack recorded in {run_dir}" in text, text
    assert not (tmp_path / "typo").exists()


def test_an_unknown_service_is_named_apart_from_the_storage(tmp_path):
    from infra.cli import app

    out = CliRunner().invoke(app, ["stack", "up", "--services", "broker,kafka", "--run-dir", str(tmp_path)])
    text = " ".join(out.output.replace("│", " ").split())
    assert out.exit_code == 2 and "unknown service(s) kafka: choose from" in text, text
    assert "storage" not in text


def test_up_with_a_model_that_does_not_exist_is_refused_before_anything_starts(tmp_path, monkeypatch):
    """`specloop up --model typo` failed with a traceback from the model load (after the suffix
    seed's set-up) instead of naming the option."""
    import infra.topology
    from infra.cli import app

    def refuse(*a, **k):
        raise AssertionError("work started: the missing model was not caught first")

    monkeypatch.setattr(infra.topology, "ensure_suffix_seed", refuse)
    monkeypatch.setattr(infra.topology, "Topology", refuse)
    out = CliRunner().invoke(app, ["up", "--model", str(tmp_path / "nope"), "--run-dir", str(tmp_path / "run")])
    text = " ".join((out.output + (out.stderr or "")).replace("│", " ").split())
    assert out.exit_code == 2 and "no such directory" in text and "--model" in text, text
    assert not (tmp_path / "run").exists()

