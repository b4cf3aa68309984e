"""``specloop stack up|down|status``: the command bodies over the local stack (infra/stack.py)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError

from infra.stack import (
    SERVICES,
    STATE_FILE,
    ServiceStartError,
    Stack,
    StackInfo,
    StackSettings,
    StateFileError,
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
    """Start the services on free loopback ports. One already running is kept, unless it was started
    with another configuration (e.g. a broker of another --storage): then it is restarted."""
    names = tuple(s.strip() for s in services.split(",") if s.strip())
    unknown = [n for n in names if n not in SERVICES]
    if unknown:
        raise typer.BadParameter(f"unknown service(s) {', '.join(unknown)}: choose from "
                                 f"{', '.join(SERVICES)}", param_hint="--services")
    if storage not in (None, "memory", "s3"):
        raise typer.BadParameter(f"storage {storage!r}: choose memory or s3", param_hint="--storage")
    stack = Stack(run_dir, stack_settings(storage))
    try:
        with state_file_errors():
            info = stack.up(names, say=lambda line: typer.echo(line, err=json_out))  # --json: one object on stdout
    except ServiceStartError as e:
        typer.echo(f"stack up failed: {e}", err=True)
        raise typer.Exit(1) from e
    _print_info(info, json_out)


def stack_settings(storage: str | None = None) -> StackSettings:
    """The stack's settings: ``--storage`` when given, else the environment's ($SPECLOOP_STACK_STORAGE).
    A bad ``SPECLOOP_STACK_*`` value is one line naming the variable (exit 1), not a traceback."""
    try:
        return StackSettings() if storage is None else StackSettings(storage=storage)
    except ValidationError as e:
        typer.echo(f"Error: {settings_error(e)}", err=True)
        raise typer.Exit(1) from None


def settings_error(exc: ValidationError) -> str:
    """StackSettings' first error (feedback/pydantic_errors.py) under the variable's name."""
    from feedback.pydantic_errors import first_error

    loc = [str(p) for p in exc.errors()[0]["loc"]]
    var = (StackSettings.model_config["env_prefix"] + (loc[0] if loc else "")).upper()
    text = first_error(exc).replace(".".join([exc.title, *loc]), var, 1)
    return f"{text}: set a valid value or unset it"


@contextlib.contextmanager
def state_file_errors() -> Iterator[None]:
    """A corrupt state file (infra/stack.py's StateFileError) as one line on stderr, exit 1."""
    try:
        yield
    except StateFileError as e:
        typer.echo(f"Error: {e}", err=True)
        raise typer.Exit(1) from None


def nothing_recorded(run_dir: Path | None, settings: StackSettings | None = None) -> bool:
    """True, and says so, when the run directory records no stack (a mistyped ``--run-dir``, or
    one already stopped): a ``down`` then has nothing to stop, and must not create the directory
    and report "nothing was running" while the stack it meant runs on elsewhere."""
    directory = resolve_run_dir(run_dir, settings)
    if (directory / STATE_FILE).is_file():
        return False
    typer.echo(f"nothing to stop: no stack recorded in {directory}")
    return True


def cmd_down(run_dir: RunDirOption = None) -> None:
    """Stop every service recorded in the run directory."""
    settings = stack_settings()
    if nothing_recorded(run_dir, settings):
        return
    with state_file_errors():
        stopped = Stack(run_dir, settings).down()
    typer.echo("stopped: " + (", ".join(stopped) if stopped else "nothing was running"))


def cmd_status(run_dir: RunDirOption = None, json_out: JsonOption = False) -> None:
    """Health of each recorded service; exits 1 if any is down, or none is recorded."""
    settings = stack_settings()
    directory = resolve_run_dir(run_dir, settings)
    if not (directory / STATE_FILE).is_file():  # checked before Stack() creates the directory
        typer.echo(f"Error: no stack recorded in {directory} (start one with `specloop stack up`)", err=True)
        raise typer.Exit(1)
    stack = Stack(directory, settings)
    with state_file_errors():
        health = stack.status()
        info = stack.info()
    if not health:
        typer.echo(f"Error: no stack recorded in {directory}: nothing is running", err=True)
        raise typer.Exit(1)
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
