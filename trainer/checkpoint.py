"""Trainer checkpoints: distiller state (model + optimizer + step + RNG) and the replay buffer.

Layout: ``<root>/ckpt-00000012/`` one complete checkpoint per save, the highest number the latest,
the ``keep`` newest kept (older ones are the fallback should the newest fail to load). A save is
atomic: every file is written and fsynced in ``<root>/.tmp-<n>/``, the directory is fsynced, then one
``rename`` makes it ``ckpt-<n>`` (and the parent directory is fsynced). A kill at any point leaves
either the previous checkpoint or the new one, never neither. Saves happen *before* offsets are
committed, so a kill loses nothing: uncommitted records are redelivered and the restored replay's
request-id dedup drops the ones already in it.

One trainer identity (tenant, drafter kind, target fingerprint: ``identity``) has a root of its own,
``<checkpoint_dir>/<identity_dirname>/`` (``identity_root``), so trainers of another kind, model or
tenant pointed at the same ``checkpoint_dir`` neither load nor prune each other's checkpoints: each
finds only its own, starts fresh where it has none, and a restart with the same settings resumes.
Each checkpoint's ``meta.json`` records its identity too: ``load`` refuses one whose recorded
identity differs (``ForeignCheckpoint``), and a save prunes only checkpoints of its own identity,
never one recording another (one placed in the wrong root by hand stays where it is).

Checkpoints of the earlier layout (``ckpt-<n>`` directly in ``checkpoint_dir``, no identity recorded)
are ignored, never adopted: nothing looks for them there, and since saves and prunes happen only
inside an identity's root they are never deleted either (``legacy`` lists them so the trainer can
say so). Adopting them would need their identity, which they never recorded; an operator who knows
whose they are can move them into that identity's root, where one without a recorded identity is
taken as that identity's (loaded and pruned like its own).

Traces are stored with the trace codec (no pickle); tensors with ``torch.save`` and read back with
``weights_only=True``. ``fault`` (tests only) is called with the name of each step as it is
reached, so a test can kill the save between any two of them.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import re
import shutil
import struct
import time
from collections.abc import Callable
from pathlib import Path

import torch

from feedback.bus import codec
from trainer.distill import Distiller
from trainer.replay import ReplayBuffer

log = logging.getLogger(__name__)

KEEP = 3
"""Checkpoints kept by default (the newest first)."""

_NAME = re.compile(r"^ckpt-(\d{8})$")
STEPS = ("tmp_dir", "distiller", "champion", "replay", "meta", "fsync_dir", "rename", "prune")
"""The steps of one save, in order (names passed to ``fault``)."""


class ForeignCheckpoint(ValueError):
    """A checkpoint recording another identity than the loader's: never loaded."""


def identity(tenant: str, drafter_kind: str | None, fingerprint) -> dict[str, str]:
    """Whose checkpoints these are: the tenant, the drafter kind and the target (``fingerprint.key()``).
    A trainer differing in any of them cannot use (and must not overwrite) another's state."""
    return {"tenant": str(tenant), "drafter_kind": str(drafter_kind or "unknown"), "target": fingerprint.key()}


def _safe(text: str, limit: int) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", text)[:limit] or "_"


def identity_dirname(ident: dict[str, str]) -> str:
    """A short, filesystem-safe, deterministic name for ``ident``'s root: readable parts (cut and
    with unsafe characters replaced) and a hash of the exact identity, so two identities that read
    the same once made safe still get different names."""
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:8]
    return ".".join([_safe(ident["tenant"], 32), _safe(ident["drafter_kind"], 16), _safe(ident["target"], 48),
                     digest])


def identity_root(checkpoint_dir: str | Path, ident: dict[str, str]) -> Path:
    """Where the checkpoints of ``ident`` live under the configured ``checkpoint_dir``."""
    return Path(checkpoint_dir) / identity_dirname(ident)


def open_root(checkpoint_dir: str | Path, ident: dict[str, str]) -> Path:
    """``ident``'s root under ``checkpoint_dir`` (trainers of another tenant, drafter kind or target
    sharing it each have their own), saying so when checkpoints of the earlier layout sit there."""
    root = identity_root(checkpoint_dir, ident)
    if old := legacy(checkpoint_dir):
        log.warning("%d checkpoint(s) of the earlier layout directly in %s are ignored (deleted only "
                    "where retention or a tenant's deletion request reaches their traces: remove "
                    "them once unneeded); this trainer's are in %s", len(old), checkpoint_dir, root)
    return root


def legacy(checkpoint_dir: str | Path) -> list[Path]:
    """Checkpoints of the earlier layout (directly in ``checkpoint_dir``): never loaded, deleted only
    where retention reaches them (``purge_legacy``)."""
    return all_checkpoints(checkpoint_dir)


def purge_legacy(checkpoint_dir: str | Path | None, tenants: list[str] = (), max_age_s: float | None = None,
                 now: float | None = None) -> list[Path]:
    """Delete the earlier layout's checkpoints that hold data retention removes: those that may hold
    a deleted tenant's traces (recording that tenant, or no identity: the earlier layout's trainers
    of every tenant shared the directory) and those saved more than ``max_age_s`` ago (every trace
    in them has expired). A trainer ignores them, but a deletion request or a retention window
    that left them on disk would not be one. Returns the deleted paths (none without a directory)."""
    if not checkpoint_dir:
        return []
    now = time.time() if now is None else now
    gone = []
    for path in legacy(checkpoint_dir):
        meta = _meta(path)
        tenant = (meta.get("identity") or {}).get("tenant")
        saved_at = meta.get("saved_at")
        expired = (max_age_s is not None and isinstance(saved_at, (int, float))
                   and now - saved_at > max_age_s)
        if expired or (tenants and (tenant is None or tenant in tenants)):
            shutil.rmtree(path, ignore_errors=True)
            gone.append(path)
    if gone:
        log.info("retention: deleted %d checkpoint(s) of the earlier layout in %s (%s)", len(gone),
                 checkpoint_dir, ", ".join(tenants) or "expired")
    return gone


def _meta(path: Path) -> dict:
    """A checkpoint's meta.json ({} if unreadable)."""
    try:
        meta = json.loads((Path(path) / "meta.json").read_text())
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def recorded_identity(path: str | Path) -> dict | None:
    """The identity checkpoint ``path`` recorded (None: none recorded, or its meta unreadable)."""
    return _meta(Path(path)).get("identity")


def _ours(path: Path, ident: dict[str, str] | None) -> bool:
    """May a save of ``ident`` prune ``path``: not when it records another identity."""
    if ident is None:
        return True
    recorded = recorded_identity(path)
    return recorded is None or recorded == ident


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _numbered(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root``, newest first."""
    if not root.is_dir():
        return []
    out = [(int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.match(p.name))]
    return sorted(out, reverse=True)


def save(root: str | Path, distiller, replay: ReplayBuffer, extra: dict | None = None,
         champion_state: dict | None = None, keep: int = KEEP,
         fault: Callable[[str], None] | None = None, ident: dict[str, str] | None = None) -> Path:
    """Write a new checkpoint under ``root`` and return its path. ``champion_state``: the champion's
    weights, inside the same atomic rename. ``ident`` (``identity``) is recorded in its metadata, and
    only ``ident``'s checkpoints are pruned (the newest ``keep`` of them kept)."""
    step = fault or (lambda name: None)
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    existing = _numbered(root)
    n = existing[0][0] + 1 if existing else 1
    tmp = root / f".tmp-{n:08d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    step("tmp_dir")
    torch.save(distiller.state_dict(), tmp / "distiller.pt")
    _fsync_file(tmp / "distiller.pt")
    step("distiller")
    if champion_state is not None:
        torch.save(champion_state, tmp / "champion.pt")
        _fsync_file(tmp / "champion.pt")
    step("champion")
    entries = sorted([*replay._train, *replay._heldout], key=lambda e: e.seq)
    with open(tmp / "replay.bin", "wb") as f:
        for e in entries:
            blob = codec.encode(e.record)
            f.write(struct.pack("<I", len(blob)))
            f.write(blob)
        f.flush()
        os.fsync(f.fileno())
    step("replay")
    meta = {"tokens_seen": replay.tokens_seen, "seen_ids": list(replay._seen_order),
            "heldout_ids": [e.record.request_id for e in replay._heldout], "saved_at": time.time(),
            **(extra or {})}
    if ident is not None:
        meta["identity"] = ident
    (tmp / "meta.json").write_text(json.dumps(meta))
    _fsync_file(tmp / "meta.json")
    step("meta")
    _fsync_dir(tmp)
    step("fsync_dir")
    final = root / f"ckpt-{n:08d}"
    tmp.rename(final)  # the one atomic step: before it the previous checkpoint is the latest
    _fsync_dir(root)
    step("rename")
    for old in [p for _, p in _numbered(root) if _ours(p, ident)][max(keep, 1):]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".tmp-*"):  # left by an earlier kill
        shutil.rmtree(stale, ignore_errors=True)
    step("prune")
    return final


def latest(root: str | Path) -> Path | None:
    """The newest complete checkpoint under ``root`` (None if there is none)."""
    found = _numbered(Path(root))
    return found[0][1] if found else None


def all_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under ``root``, newest first."""
    return [p for _, p in _numbered(Path(root))]


def exists(root: str | Path) -> bool:
    return latest(root) is not None


def load(path: str | Path, distiller, replay: ReplayBuffer, ident: dict[str, str] | None = None) -> dict:
    """Restore one checkpoint directory into a fresh distiller and an empty replay buffer; returns
    the extra metadata. Traces older than the replay's ``max_age_s`` (if set) are not restored.
    ``ident``: the loader's identity; a checkpoint recording another raises ``ForeignCheckpoint``
    before anything is loaded (one recording none, the earlier layout's, is taken as ``ident``'s)."""
    path = Path(path)
    meta = json.loads((path / "meta.json").read_text())
    recorded = meta.pop("identity", None)
    if ident is not None and recorded is not None and recorded != ident:
        raise ForeignCheckpoint(f"checkpoint {path} is {recorded}'s, not {ident}'s")
    # read onto the CPU: a checkpoint a CUDA trainer wrote restores on a CPU one (and back); the
    # weights and the optimizer's state are copied onto the student's device as they load
    distiller.load_state_dict(torch.load(path / "distiller.pt", weights_only=True, map_location="cpu"))
    kept = "heldout_ids" in meta  # the split as it was, not re-derived (see ReplayBuffer.min_heldout)
    heldout = set(meta.pop("heldout_ids", []))
    meta.pop("saved_at", None)
    data = (path / "replay.bin").read_bytes()
    i = 0
    while i < len(data):
        (n,) = struct.unpack_from("<I", data, i)
        record = codec.decode(data[i + 4 : i + 4 + n])
        i += 4 + n
        replay.add(record, heldout=(record.request_id in heldout) if kept else None)
    replay.tokens_seen = meta.pop("tokens_seen")
    for rid in meta.pop("seen_ids"):
        replay.remember(rid)
    return meta


def load_latest(root: str | Path, make: Callable[[], tuple], ident: dict[str, str] | None = None
                ) -> tuple[Path, object, ReplayBuffer, dict] | None:
    """Load the newest checkpoint under ``root`` that loads, falling back to older ones.
    ``make()`` returns a fresh ``(distiller, replay)`` for each attempt. None if none loads.
    ``ident``: checkpoints recording another identity are skipped (``load``)."""
    for path in all_checkpoints(root):
        distiller, replay = make()
        try:
            return path, distiller, replay, load(path, distiller, replay, ident)
        except ForeignCheckpoint as e:
            log.error("%s: not loaded (left in place); trying an older one", e)
        except Exception:
            log.exception("checkpoint %s does not load; trying an older one", path)
    return None


def restore(root: str | Path, distiller: Distiller, replay: ReplayBuffer, ident: dict[str, str] | None = None
            ) -> tuple[Path | None, Distiller, ReplayBuffer, dict]:
    """``load_latest`` for a running trainer: the first attempt loads in place into ``distiller``
    and ``replay`` (callers may hold the student); a fallback to an older checkpoint starts again
    from clean copies of them. Returns ``(path, distiller, replay, meta)``; when none loads, path is
    None and the distiller and replay are clean copies (a partial load undone)."""
    student, clean, cfg = copy.deepcopy(distiller.student), copy.deepcopy(replay), distiller.cfg
    attempts = []

    def fresh() -> tuple[Distiller, ReplayBuffer]:
        attempts.append(1)
        if len(attempts) == 1:
            return distiller, replay
        return Distiller(copy.deepcopy(student), cfg), copy.deepcopy(clean)

    found = load_latest(root, fresh, ident)
    if found is None:
        log.error("no checkpoint under %s loads; starting fresh", root)
        return None, Distiller(student, cfg), clean, {}
    return found


def champion_state(path: str | Path) -> dict | None:
    """The champion's weights saved in checkpoint ``path`` (None if it had no champion)."""
    champ = Path(path) / "champion.pt"
    return torch.load(champ, weights_only=True, map_location="cpu") if champ.exists() else None
