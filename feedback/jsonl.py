"""JSON Lines reading shared by the prompt sets (infra/prompts.py) and the trainer's offline mode
(trainer/offline.py): blank lines skipped, a bad line named by its number."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path


def iter_jsonl(path: str | Path) -> Iterator[tuple[int, object]]:
    """(line number, parsed value) for every non-blank line; ValueError naming the line if one is
    not JSON."""
    for n, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield n, json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e})") from None
