"""Trainer checkpoints: distiller state (model + optimizer + step + RNG) and the replay buffer.

Written atomically (temp dir, then rename) *before* offsets are committed, so a kill at any point
loses nothing: uncommitted records are redelivered and the restored replay's request-id dedup
drops the ones already in it. Traces are stored with the trace codec (no pickle); tensors with
``torch.save`` and read back with ``weights_only=True``.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import torch

from feedback import codec
from trainer.replay import ReplayBuffer


def save(path: str | Path, distiller, replay: ReplayBuffer, extra: dict | None = None,
         champion_state: dict | None = None) -> None:
    """``champion_state``: the champion's weights, written inside the same atomic rename."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    torch.save(distiller.state_dict(), tmp / "distiller.pt")
    if champion_state is not None:
        torch.save(champion_state, tmp / "champion.pt")
    entries = sorted([*replay._train, *replay._heldout], key=lambda e: e.seq)
    with open(tmp / "replay.bin", "wb") as f:
        for e in entries:
            blob = codec.encode(e.record)
            f.write(struct.pack("<I", len(blob)))
            f.write(blob)
    meta = {"tokens_seen": replay.tokens_seen, "seen_ids": list(replay._seen_order),
            "heldout_ids": [e.record.request_id for e in replay._heldout], **(extra or {})}
    (tmp / "meta.json").write_text(json.dumps(meta))
    old = path.with_name(path.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        path.rename(old)
    tmp.rename(path)
    shutil.rmtree(old, ignore_errors=True)


def exists(path: str | Path) -> bool:
    return (Path(path) / "meta.json").exists()


def load(path: str | Path, distiller, replay: ReplayBuffer) -> dict:
    """Restore into a fresh distiller and an empty replay buffer; returns the extra metadata."""
    path = Path(path)
    distiller.load_state_dict(torch.load(path / "distiller.pt", weights_only=True))
    meta = json.loads((path / "meta.json").read_text())
    kept = "heldout_ids" in meta  # the split as it was, not re-derived (see ReplayBuffer.min_heldout)
    heldout = set(meta.pop("heldout_ids", []))
    data = (path / "replay.bin").read_bytes()
    i = 0
    while i < len(data):
        (n,) = struct.unpack_from("<I", data, i)
        record = codec.decode(data[i + 4 : i + 4 + n])
        replay.add(record, heldout=(record.request_id in heldout) if kept else None)
        i += 4 + n
    replay.tokens_seen = meta.pop("tokens_seen")
    for rid in meta.pop("seen_ids"):
        replay.remember(rid)
    return meta
