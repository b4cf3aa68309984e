"""`specloop demo --run-dir DIR` refuses a directory that holds an earlier run's results, before the
model loads or the stack starts, unless --overwrite (which removes those results first, so that
the directory never mixes two runs). Before, a second run silently wrote over the first one's
summary, events, points and plot."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from infra.demo import RUN_FILES


class Started(Exception):
    """Raised where the demo would start the stack: the run directory was accepted (and made)."""


@pytest.fixture
def no_demo(monkeypatch):
    import infra.root
    import serving.target

    def start(*a, **k):
        raise Started

    monkeypatch.setattr(serving.target, "load_target", lambda *a, **k: object())  # loaded first
    monkeypatch.setattr(infra.root, "build_stack", start)
    monkeypatch.setenv("COLUMNS", "1000")  # the usage error's panel folds no path


def demo(*args: str):
    from infra.cli import app

    return CliRunner().invoke(app, ["demo", "--suffix-seed", "0", *args])


def earlier_run(run_dir):
    run_dir.mkdir()
    for name in RUN_FILES:
        (run_dir / name).write_text(f"earlier {name}")
    (run_dir / "notes.txt").write_text("mine")
    return {p.name: p.read_text() for p in run_dir.iterdir()}


@pytest.mark.usefixtures("no_demo")
def test_a_run_dir_with_an_earlier_run_is_refused_before_anything_starts(tmp_path):
    run_dir = tmp_path / "run"
    before = earlier_run(run_dir)

    result = demo("--run-dir", str(run_dir))

    text = " ".join((result.output + (result.stderr or "")).replace("│", " ").split())
    assert result.exit_code == 2 and f"{run_dir} holds an earlier run" in text and "--overwrite" in text, text
    assert {p.name: p.read_text() for p in run_dir.iterdir()} == before


@pytest.mark.usefixtures("no_demo")
def test_overwrite_removes_the_earlier_results_and_starts(tmp_path):
    run_dir = tmp_path / "run"
    earlier_run(run_dir)

    result = demo("--run-dir", str(run_dir), "--overwrite")

    assert isinstance(result.exception, Started), result.output
    assert sorted(p.name for p in run_dir.iterdir()) == ["notes.txt"]  # the user's own file stays


@pytest.mark.usefixtures("no_demo")
@pytest.mark.parametrize("case", ["new", "no earlier summary", "default"])
def test_a_run_dir_without_an_earlier_run_is_used(case, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    if case == "no earlier summary":  # e.g. a run interrupted before its end
        run_dir.mkdir()
        (run_dir / "stack").mkdir()
    args = ["--run-dir", str(run_dir)]
    if case == "default":  # ./specloop-demo/<timestamp>
        monkeypatch.chdir(tmp_path)
        args = []

    result = demo(*args)

    assert isinstance(result.exception, Started), result.output
    made = run_dir if case != "default" else next((tmp_path / "specloop-demo").iterdir())
    assert made.is_dir()
