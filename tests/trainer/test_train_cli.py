"""`specloop train`'s arguments are checked before the target is loaded (or minutes of generation)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner


@pytest.mark.parametrize("args", [["--offline", "/no/such/prompts.jsonl"],
                                  ["--requests", "4", "--init", "/no/such/artifact"]])
def test_a_missing_prompt_file_or_init_artifact_is_a_usage_error(args, monkeypatch):
    import trainer.cli
    from infra.cli import app

    def refuse(*a, **k):
        raise AssertionError("training started: the bad path was not caught first")

    monkeypatch.setattr(trainer.cli, "run_offline", refuse)
    result = CliRunner().invoke(app, ["train", *args])
    out = " ".join((result.output + (result.stderr or "")).replace("│", " ").split())
    assert result.exit_code == 2 and "does not exist" in out, out
    assert isinstance(result.exception, SystemExit)


def test_a_negative_round_count_is_a_usage_error():
    from infra.cli import app

    result = CliRunner().invoke(app, ["train", "--rounds", "-1"])
    assert result.exit_code == 2, result.output
