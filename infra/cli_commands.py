"""Registration of every CLI command on the apps infra/cli.py creates. Keep one line per command;
``specloop bench``'s commands are the ``specloop.bench`` entry points in pyproject.toml.

The apps are passed in (not imported from infra.cli), so there is no import cycle and
``python -m infra.cli`` registers the same commands as the ``specloop`` entry point."""

from __future__ import annotations

from importlib.metadata import entry_points

import typer


def register(app: typer.Typer, stack_app: typer.Typer, bench_app: typer.Typer) -> None:

    from infra import stack_cli as _stack_cli  # light: stdlib, pydantic, typer

    stack_app.command("up")(_stack_cli.cmd_up)
    stack_app.command("down")(_stack_cli.cmd_down)
    stack_app.command("status")(_stack_cli.cmd_status)

    from infra import topology as _topology  # light: yaml, pydantic, typer

    app.command("up")(_topology.cmd_up)
    app.command("down")(_topology.cmd_down)
    from infra import restart as _restart  # light: stdlib, typer

    app.command("restart-policy")(_restart.cmd_restart_policy)

    from infra import (
        root as _root,  # light: pydantic settings; heavy imports happen inside commands
    )
    from serving import cli as serving_cli

    serving_cli.use_settings(_root.serving_settings)  # one settings tree for every process
    app.command("serve")(serving_cli.serve)
    app.command("generate")(serving_cli.generate)

    from trainer import cli as trainer_cli  # light: heavy imports happen inside the command

    trainer_cli.use_settings(_root.trainer_settings)
    from infra.offline_generation import engine_generator  # light: heavy imports inside

    trainer_cli.use_generator(engine_generator)
    app.command("train")(trainer_cli.train)
    from infra import suffix_seed as _suffix_seed  # light: heavy imports happen inside the command

    app.command("suffix-seed")(_suffix_seed.cmd_suffix_seed)

    from infra import demo as _demo  # light: heavy imports happen inside the command

    app.command("demo")(_demo.demo)
    register_benchmarks(bench_app)


BENCH_GROUP = "specloop.bench"
"""The entry-point group (pyproject.toml) through which benchmarks/ adds ``specloop bench``'s
commands: benchmarks sit on top of every package, so none of ours imports them by name."""


def register_benchmarks(bench_app: typer.Typer) -> list[str]:
    """Attach every installed ``specloop.bench`` entry point as ``specloop bench NAME``; returns the
    names. Loading one imports its module, which keeps heavy imports inside the command."""
    names = []
    for ep in sorted(entry_points(group=BENCH_GROUP), key=lambda e: e.name):
        bench_app.command(ep.name)(ep.load())
        names.append(ep.name)
    return names
