"""The benchmarks' --bf16-activations flag runs what `specloop serve` would: the environment's
SPECLOOP_BF16_ACTIVATIONS where set (its help named it, and ignored it), else serving's default."""

from __future__ import annotations

import typer
from typer.testing import CliRunner

from benchmarks.engine_options import (
    BF16_ACTIVATIONS_ENV,
    bf16_activations_option,
    served_bf16_activations,
)
from serving.config import ServingSettings

app = typer.Typer()


@app.command()
def show(bf16_activations: bool = bf16_activations_option()) -> None:
    print(f"bf16={bf16_activations}")


def _run(args: list[str], env: dict[str, str | None]) -> str:
    result = CliRunner().invoke(app, args, env=env)
    assert result.exit_code == 0, result.output
    return result.output.strip()


def test_the_flag_reads_the_variable_serving_reads(monkeypatch):
    monkeypatch.delenv(BF16_ACTIVATIONS_ENV, raising=False)
    for value, expected in (("0", False), ("false", False), ("1", True), ("true", True)):
        assert _run([], {BF16_ACTIVATIONS_ENV: value}) == f"bf16={expected}"
        monkeypatch.setenv(BF16_ACTIVATIONS_ENV, value)
        assert ServingSettings().bf16_activations is expected  # the same name, the same meaning
        monkeypatch.delenv(BF16_ACTIVATIONS_ENV)
    assert _run([], {BF16_ACTIVATIONS_ENV: None}) == f"bf16={served_bf16_activations()}"


def test_an_explicit_flag_wins_over_the_environment():
    assert _run(["--exact-activations"], {BF16_ACTIVATIONS_ENV: "1"}) == "bf16=False"
    assert _run(["--bf16-activations"], {BF16_ACTIVATIONS_ENV: "0"}) == "bf16=True"
