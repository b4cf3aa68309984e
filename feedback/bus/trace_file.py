"""Traces on disk: length-prefixed trace codec blobs (no pickle), for caches of traces that are
costly to make (served benchmark traces, teacher-forced corpora)."""

from __future__ import annotations

from pathlib import Path

from feedback.bus import codec
from feedback.bus.trace import TraceRecord


def save_traces(records: list[TraceRecord], path: str | Path) -> None:
    """Write atomically (a temp sibling renamed into place)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "wb") as f:
        for r in records:
            blob = codec.encode(r)
            f.write(len(blob).to_bytes(4, "little"))
            f.write(blob)
    tmp.replace(path)


def load_traces(path: str | Path) -> list[TraceRecord]:
    data = Path(path).read_bytes()
    out, i = [], 0
    while i < len(data):
        n = int.from_bytes(data[i : i + 4], "little")
        out.append(codec.decode(data[i + 4 : i + 4 + n]))
        i += 4 + n
    return out
