"""A settings or option error as one line for a command line: serving's, the trainer's and infra's
CLIs all report bad settings and options with it."""

from __future__ import annotations

import os
import re

from pydantic import ValidationError
from pydantic_settings import SettingsError

SETTINGS_ERRORS = (ValidationError, SettingsError)
"""What building a settings class raises for a bad environment value: pydantic's ValidationError
for a value it read and refused, pydantic-settings' SettingsError for one it could not even parse
(a JSON-typed field, a list or dict, set to ``[1,``)."""

_UNPARSED = re.compile(r'error (?:getting|parsing) value for field "(\w+)"')


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


def first_settings_error(exc: ValidationError | SettingsError) -> str:
    """Either of ``SETTINGS_ERRORS`` in one line. A SettingsError names only the field; the
    ``SPECLOOP_*`` variable that sets it is named (with its value, when short) where exactly one
    set variable ends in the field's name, and the parser's own complaint (e.g. JSON's) follows."""
    if isinstance(exc, ValidationError):
        return first_error(exc)
    text = " ".join(str(exc).split())
    cause = exc.__cause__
    why = f": {' '.join(str(cause).split()) or type(cause).__name__}" if cause is not None else ""
    m = _UNPARSED.match(text)
    names = [k for k in os.environ
             if m and k.upper().startswith("SPECLOOP_") and k.upper().endswith(f"_{m.group(1).upper()}")]
    if len(names) != 1:
        return text + why
    given = os.environ[names[0]]
    return f"{names[0]}: could not be parsed{why}" + (f" (got {given!r})" if len(repr(given)) <= 80 else "")
