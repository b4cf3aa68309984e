"""The ``specloop`` command line. Each area keeps its commands in its own module; this file wires
them together and imports them lazily so ``specloop --help`` stays fast."""

from __future__ import annotations

from infra import omp_env

omp_env.configure()  # before anything imports torch (why: infra/omp_env.py)

import typer

app = typer.Typer(help="specloop: speculative decoding whose drafter learns from live traffic.",
                  no_args_is_help=True, pretty_exceptions_show_locals=False)
stack_app = typer.Typer(help="Start, check and stop the local service stack (broker, Redis, MLflow).",
                        no_args_is_help=True)
bench_app = typer.Typer(help="Benchmarks; each prints one JSON object on stdout, compact (--json, the "
                        "default) or indented (--no-json).", no_args_is_help=True)
app.add_typer(stack_app, name="stack")
app.add_typer(bench_app, name="bench")

# Command registrations: one place lists the whole CLI. Modules define plain functions with Typer
# annotations; infra/cli_commands.py attaches them to the apps above.
from infra import cli_commands

cli_commands.register(app, stack_app, bench_app)

if __name__ == "__main__":
    app()
