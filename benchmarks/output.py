"""How every ``specloop bench`` command prints its result: one JSON object on stdout (progress goes
to stderr), compact on one line by default, indented for humans with ``--no-json``."""

from __future__ import annotations

import json
from typing import Any

import typer

JSON_HELP = "One JSON object on stdout, compact (default) or indented."


def json_option() -> Any:
    """The ``--json/--no-json`` option every bench command takes (its default: compact)."""
    return typer.Option(True, "--json/--no-json", help=JSON_HELP)


def print_json(out: dict, compact: bool = True) -> None:
    """Print ``out`` as one JSON object: one line, or indented; numpy scalars print as numbers."""
    print(json.dumps(out, indent=None if compact else 2, default=float))
