"""Registration of every CLI command (see infra/cli.py). Keep one line per command."""

from __future__ import annotations
