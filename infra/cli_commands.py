"""Registration of every CLI command (see infra/cli.py). Keep one line per command."""

from __future__ import annotations

from infra import stack as _stack  # light: stdlib, pydantic, typer
from infra.cli import stack_app

stack_app.command("up")(_stack.cmd_up)
stack_app.command("down")(_stack.cmd_down)
stack_app.command("status")(_stack.cmd_status)

from infra.cli import app
from serving import cli as serving_cli

app.command("serve")(serving_cli.serve)
app.command("generate")(serving_cli.generate)

from trainer import cli as trainer_cli  # noqa: E402  (light: heavy imports happen inside the command)

app.command("train")(trainer_cli.train)

from infra.cli import bench_app  # noqa: E402
from benchmarks import bench_train  # noqa: E402  (light: heavy imports happen inside the command)

bench_app.command("train")(bench_train.bench_train)
from benchmarks import bench_swap  # noqa: E402  (light: heavy imports happen inside the command)

bench_app.command("swap")(bench_swap.bench_swap)

from infra.cli import bench_app  # noqa: E402
from benchmarks import cli as bench_cli  # noqa: E402

bench_app.command("spec")(bench_cli.spec)
bench_app.command("capture")(bench_cli.capture)

from infra import demo as _demo  # noqa: E402  (light: heavy imports happen inside the command)

app.command("demo")(_demo.demo)
from benchmarks import bench_online  # noqa: E402  (light: heavy imports happen inside the command)

bench_app.command("online")(bench_online.bench_online)
