"""Every `specloop bench` command prints one JSON object on stdout: compact on one line by default
(`--json`), the same object indented with `--no-json`."""

from __future__ import annotations

import json

import numpy as np
import typer
from typer.main import get_command

from benchmarks.output import print_json
from infra.cli_commands import register_benchmarks


def _json_options() -> dict:
    app = typer.Typer()
    register_benchmarks(app)
    return {name: next(p for p in cmd.params if p.name == "json_out")
            for name, cmd in get_command(app).commands.items()}


def test_every_bench_takes_json_or_no_json_and_defaults_to_compact():
    options = _json_options()
    assert len(options) == 8
    for name, opt in options.items():
        assert (opt.opts, opt.secondary_opts, opt.default) == (["--json"], ["--no-json"], True), name


def test_bench_trains_default_output_is_one_json_line(capsys):
    # the shape of bench train's result: nested curve, None, a numpy scalar from the scoring
    out = {"model": "SmolLM2-135M-Instruct", "init": None, "sim_speedup_after": np.float32(1.25),
           "curve": [{"trace_tokens_seen": 1280, "expected_acceptance": 0.27, "train_steps": 40}]}
    print_json(out, _json_options()["train"].default)
    printed = capsys.readouterr().out
    assert printed.count("\n") == 1
    assert json.loads(printed) == {**out, "sim_speedup_after": 1.25}


def test_no_json_prints_the_same_object_indented(capsys):
    out = {"speedup": 1.5, "by_domain": {"chat": 1.4, "code": 1.6}}
    print_json(out, compact=False)
    printed = capsys.readouterr().out
    assert printed.count("\n") > 1
    assert json.loads(printed) == out
