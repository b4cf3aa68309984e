"""A pydantic ValidationError as one line for a command line: serving's and the trainer's CLIs
both report bad settings and options with it."""

from __future__ import annotations

from pydantic import ValidationError


def first_error(exc: ValidationError) -> str:
    """Its first error, where and what, the value given (when short) and how many more."""
    errors = exc.errors()
    err = errors[0]
    where = ".".join(str(p) for p in err["loc"])
    text = f"{exc.title}.{where}: {err['msg']}" if where else f"{exc.title}: {err['msg']}"
    given = err.get("input")
    if err.get("type") != "missing" and isinstance(given, str | int | float) and len(repr(given)) <= 80:
        text += f" (got {given!r})"
    return text + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else "")
