"""`specloop train` online (no --offline/--corpus/--requests) refuses the options only an offline run
reads (--out, --steps, --max-new-tokens, --model-id, --corpus-cache): a usage error naming them,
before the settings are read, the model loads or Ray starts (trainer/train_options.py). Before, online
training ignored them silently. "Given" is the option's source, not its value: the default value
typed out is refused too, and offline the same options still work."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner


@pytest.fixture
def nothing_starts(monkeypatch):
    """Online training and offline training, each replaced by a failure (or a record)."""
    import feedback.target.location
    import trainer.actor
    import trainer.cli

    def fail(what):
        def refuse(*a, **k):
            raise AssertionError(f"{what} before the options were checked")

        return refuse

    monkeypatch.setattr(trainer.cli, "_settings", fail("the settings were read"))
    monkeypatch.setattr(feedback.target.location, "model_fingerprint", fail("the model loaded"))
    monkeypatch.setattr(trainer.actor, "start_actor", fail("Ray started"))
    monkeypatch.setenv("COLUMNS", "1000")  # the usage error's panel folds nothing


def train(*args: str):
    from infra.cli import app

    return CliRunner().invoke(app, ["train", *args])


def text(result) -> str:
    return " ".join((result.output + (result.stderr or "")).replace("│", " ").split())


@pytest.mark.usefixtures("nothing_starts")
@pytest.mark.parametrize("option,value", [("--out", "specloop-static-drafter"),  # its default, given
                                          ("--steps", "400"),  # its default, given
                                          ("--steps", "10"),
                                          ("--max-new-tokens", "64"),  # its default, given
                                          ("--model-id", "my-target"),
                                          ("--corpus-cache", "/tmp/specloop-cache")])
def test_an_offline_only_option_online_is_a_usage_error_naming_it(option, value):
    result = train("--rounds", "1", option, value)

    out = text(result)
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), out
    assert f"{option}: only for --offline/--corpus/--requests" in out, out
    assert "Traceback" not in result.output


@pytest.mark.usefixtures("nothing_starts")
def test_every_offline_only_option_given_is_named_in_one_line(tmp_path):
    result = train("--steps", "5", "--model-id", "x", "--out", str(tmp_path / "d"))

    out = text(result)
    assert result.exit_code == 2, out
    assert "--out, --model-id, --steps: only for --offline/--corpus/--requests" in out, out
    assert "does not use them" in out, out
    assert not (tmp_path / "d").exists()


@pytest.mark.usefixtures("nothing_starts")
def test_rounds_in_an_offline_run_is_a_usage_error(tmp_path):
    """The reverse: --rounds bounds the online trainer; an offline run ignored it."""
    result = train("--corpus", "1", "--rounds", "3", "--out", str(tmp_path / "d"))

    out = text(result)
    assert result.exit_code == 2, out
    assert "--rounds: only for online training" in out, out
    assert not (tmp_path / "d").exists()


def test_online_without_them_and_offline_with_them_go_on(monkeypatch, tmp_path):
    import trainer.cli

    seen = []
    monkeypatch.setattr(trainer.cli, "_train", lambda *a: seen.append(a))

    online = train("--rounds", "2")  # no offline-only option: the online trainer runs
    offline = train("--corpus", "1", "--steps", "5", "--max-new-tokens", "8", "--model-id", "m",
                    "--corpus-cache", str(tmp_path / "cache"), "--out", str(tmp_path / "d"))

    assert online.exit_code == 0 and offline.exit_code == 0, text(online) + text(offline)
    assert [a[1] for a in seen] == [2, 0] and seen[1][-3:] == ("m", 8, 5)
