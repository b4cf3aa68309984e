"""`specloop bench`'s commands arrive through the `specloop.bench` entry points (pyproject.toml), so
that infra never imports benchmarks/ by name (tests/test_layering.py): every benchmark with a
command is registered, and runs through the one CLI."""

from __future__ import annotations

import typer
from typer.testing import CliRunner

from infra.cli_commands import register_benchmarks

EXPECTED = {"capture", "engine", "interference", "load", "online", "spec", "swap", "train"}


def test_every_benchmark_command_is_registered_from_its_entry_point():
    app = typer.Typer()
    names = register_benchmarks(app)
    assert set(names) == EXPECTED
    registered = {c.name: c.callback for c in app.registered_commands}
    assert set(registered) == EXPECTED
    assert all(cb.__module__.startswith("benchmarks.") for cb in registered.values())


def test_the_specloop_cli_runs_a_benchmark_command():
    from infra.cli import app

    out = CliRunner().invoke(app, ["bench", "spec", "--help"])
    assert out.exit_code == 0, out.output
    assert "--drafter" in out.output
    out = CliRunner().invoke(app, ["bench", "nosuch"])
    assert out.exit_code != 0
