"""``specloop stack up|down|status``: the command bodies over the local stack (infra/stack.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from infra.stack import (
    SERVICES,
    STATE_FILE,
    ServiceStartError,
    Stack,
    StackInfo,
    StackSettings,
    resolve_run_dir,
)

# ---- CLI (registered in infra/cli_commands.py) -------------------------------------------------

RunDirOption = Annotated[Path | None, typer.Option(
    help="State/log directory (default: $SPECLOOP_STACK_RUN_DIR or ~/.specloop/stack).")]
JsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON object.")]


def cmd_up(
    services: Annotated[str, typer.Option(help="Comma-separated: broker, redis, mlflow, s3.")]
    = "broker,redis,mlflow",
    storage: Annotated[str | None, typer.Option(
        help="Broker storage: memory or s3 (default: $SPECLOOP_STACK_STORAGE or memory).")] = None,
    run_dir: RunDirOption = None,
    json_out: JsonOption = False,
) -> None:
    """Start the services on free loopback ports (those already running are kept)."""
    names = tuple(s.strip() for s in services.split(",") if s.strip())
    unknown = [n for n in names if n not in SERVICES]
    if unknown:
        raise typer.BadParameter(f"unknown service(s) {', '.join(unknown)}: choose from "
                                 f"{', '.join(SERVICES)}", param_hint="--services")
    if storage not in (None, "memory", "s3"):
        raise typer.BadParameter(f"storage {storage!r}: choose memory or s3", param_hint="--storage")
    stack = Stack(run_dir, stack_settings(storage))
    try:
        info = stack.up(names)
    except ServiceStartError as e:
        typer.echo(f"stack up failed: {e}", err=True)
        raise typer.Exit(1) from e
    _print_info(info, json_out)


def stack_settings(storage: str | None) -> StackSettings:
    """The stack's settings: ``--storage`` when given, else the environment's ($SPECLOOP_STACK_STORAGE)."""
    return StackSettings() if storage is None else StackSettings(storage=storage)


def nothing_recorded(run_dir: Path | None) -> bool:
    """True, and says so, when the run directory records no stack (a mistyped ``--run-dir``, or
    one already stopped): a ``down`` then has nothing to stop, and must not create the directory
    and report "nothing was running" while the stack it meant runs on elsewhere."""
    directory = resolve_run_dir(run_dir)
    if (directory / STATE_FILE).is_file():
        return False
    typer.echo(f"nothing to stop: no stack recorded in {directory}")
    return True


def cmd_down(run_dir: RunDirOption = None) -> None:
    """Stop every service recorded in the run directory."""
    if nothing_recorded(run_dir):
        return
    stopped = Stack(run_dir).down()
    typer.echo("stopped: " + (", ".join(stopped) if stopped else "nothing was running"))


def cmd_status(run_dir: RunDirOption = None, json_out: JsonOption = False) -> None:
    """Health of each recorded service; exits 1 if any is down, or none is recorded."""
    directory = resolve_run_dir(run_dir)
    if not (directory / STATE_FILE).is_file():  # checked before Stack() creates the directory
        typer.echo(f"Error: no stack recorded in {directory} (start one with `specloop stack up`)", err=True)
        raise typer.Exit(1)
    stack = Stack(directory)
    health = stack.status()
    if not health:
        typer.echo(f"Error: no stack recorded in {directory}: nothing is running", err=True)
        raise typer.Exit(1)
    info = stack.info()
    if json_out:
        typer.echo(json.dumps({"healthy": health, **info.model_dump(exclude={"services"})}))
    else:
        for name, ok in health.items():
            typer.echo(f"{name:7s} {'healthy' if ok else 'DOWN'}")
        _print_info(info, False)
    if not all(health.values()):
        raise typer.Exit(1)


def _print_info(info: StackInfo, json_out: bool) -> None:
    if json_out:
        typer.echo(info.model_dump_json(exclude={"services"}))
        return
    for key, value in info.env().items():
        typer.echo(f"export {key}={value}")
