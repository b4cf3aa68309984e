"""Registration of every CLI command on the apps infra/cli.py creates. Keep one line per command.

The apps are passed in (not imported from infra.cli), so there is no import cycle and
``python -m infra.cli`` registers the same commands as the ``specloop`` entry point."""

from __future__ import annotations

import typer


def register(app: typer.Typer, stack_app: typer.Typer, bench_app: typer.Typer) -> None:

    from infra import stack as _stack  # light: stdlib, pydantic, typer

    stack_app.command("up")(_stack.cmd_up)
    stack_app.command("down")(_stack.cmd_down)
    stack_app.command("status")(_stack.cmd_status)

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
    app.command("train")(trainer_cli.train)

    from benchmarks import bench_train  # light: heavy imports happen inside the command

    bench_app.command("train")(bench_train.bench_train)
    from benchmarks import bench_swap  # light: heavy imports happen inside the command

    bench_app.command("swap")(bench_swap.bench_swap)

    from benchmarks import cli as bench_cli

    bench_app.command("spec")(bench_cli.spec)
    bench_app.command("capture")(bench_cli.capture)

    from infra import demo as _demo  # light: heavy imports happen inside the command

    app.command("demo")(_demo.demo)
    from benchmarks import bench_online  # light: heavy imports happen inside the command

    bench_app.command("online")(bench_online.bench_online)
    from benchmarks import bench_load  # light: heavy imports happen inside the command

    bench_app.command("load")(bench_load.bench_load)
    from benchmarks import bench_engine  # light: heavy imports happen inside the command

    bench_app.command("engine")(bench_engine.bench_engine)
    from benchmarks import bench_interference  # light: heavy imports happen inside the command

    bench_app.command("interference")(bench_interference.bench_interference)
