"""The drafter artifact: what the trainer publishes and serving loads.

A directory with two files, no pickle anywhere:

    config.json        DrafterMeta: kind, model config, draft vocabulary (size + sha256), target
                       fingerprint, version, parent version, created_at, sha256 of each weight file
    model.safetensors  the model's state dict (tied tensors stored once; the EAGLE head's token
                       embedding is the target's and is not stored; a selfspec drafter stores
                       only its adapter: the layers, embeddings and lm_head it shares with the
                       target are pinned by the fingerprint, never copied; nor are tensors a
                       standalone drafter keeps frozen as the target's, its token embedding: see
                       feedback/registry/shared_tensors.py)
    draft_vocab.safetensors
                       standalone only, when it was trained at a draft vocabulary: the sorted
                       target ids whose lm_head rows it reads (serving reads the same rows; a
                       draft token then costs Vd/V of the vocabulary projection)

``load_drafter`` validates everything before it returns a model: target fingerprint, checksums,
tensor names and shapes against the config, the drafter's vocabulary against the
fingerprint's, finite weights, draft-vocabulary consistency. Anything
wrong raises ``DrafterArtifactError`` with a message that says what and where.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Mapping
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from feedback.drafters.eagle_head import EagleHead, EagleHeadConfig
from feedback.drafters.from_target import SelfSpecAdapter, adapter_of, check_draft_vocab
from feedback.drafters.kinds import DrafterConfig, build_model, kind_of, parse_config
from feedback.drafters.vocab import checked_vocab_ids
from feedback.registry.shared_tensors import TargetTensors, share, tensor_digest
from feedback.target.fingerprint import TargetFingerprint

ARTIFACT_FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
DRAFT_VOCAB_FILE = "draft_vocab.safetensors"


class DrafterArtifactError(Exception):
    """A drafter artifact that must not be served (wrong target, corrupt, inconsistent, NaN)."""


class DrafterMeta(BaseModel):
    """Contents of an artifact's config.json."""

    model_config = ConfigDict(extra="forbid")

    format_version: int = ARTIFACT_FORMAT_VERSION
    kind: str
    """eagle | standalone | selfspec (selfspec stores only its adapter; see drafters_from_target)"""
    version: str
    parent_version: str | None = None
    created_at: float = Field(default_factory=time.time)
    target: TargetFingerprint
    config: dict
    """The model config (EagleHeadConfig or StandaloneConfig fields)."""
    dtype: str
    draft_vocab_size: int | None = None
    draft_vocab_sha256: str | None = None
    """sha256 of the draft vocabulary's target ids (int64 little-endian): eagle, and standalone
    trained at a draft vocabulary."""
    files: dict[str, str]
    """file name -> sha256 hex of its bytes"""
    extra: dict = Field(default_factory=dict)
    """Free-form lineage (trace offsets, metrics); not validated."""
    from_target: dict[str, str] = Field(default_factory=dict)
    """Tensors not stored because they are the target's: name -> ``tensor_digest`` in the
    artifact's dtype (feedback/registry/shared_tensors.py). Load with the target's tensors."""

    def model_cfg(self) -> DrafterConfig:
        return parse_config(self.kind, self.config)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _vocab_hash(ids: torch.Tensor) -> str:
    return hashlib.sha256(
        ids.to(torch.int64).cpu().contiguous().numpy().astype("<i8").tobytes()
    ).hexdigest()


def _stored_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with tied tensors kept once (first name wins)."""
    seen: set[tuple[int, int]] = set()
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key in seen:
            continue
        seen.add(key)
        out[name] = t.detach().cpu().contiguous()
    return out


def _non_finite(state: dict[str, torch.Tensor]) -> list[str]:
    """Names of the floating tensors holding a NaN or an infinity. Their min and max say it (both
    propagate NaN) in one pass without the [numel] bool tensor of ``isfinite``: 4x faster."""
    bad = []
    for n, t in state.items():
        if t.is_floating_point() and t.numel():
            lo, hi = torch.aminmax(t.detach())
            if not (bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))):
                bad.append(n)
    return bad


def save_drafter(
    model: nn.Module,
    config: DrafterConfig,
    fingerprint: TargetFingerprint,
    directory: str | Path,
    *,
    version: str,
    parent_version: str | None = None,
    extra: dict | None = None,
    overwrite: bool = False,
    draft_vocab: torch.Tensor | None = None,
    from_target: Mapping[str, str] | None = None,
) -> DrafterMeta:
    """Write ``model`` as an artifact directory (atomically: a temp sibling renamed into place).
    ``draft_vocab``: standalone only, the [Vd] target ids its lm_head was trained to be read at.
    ``from_target``: {name: digest} of the target's tensors the model may share
    (``shared_with_target``); each of the model's tensors whose digest still agrees is left out and
    recorded instead."""
    directory = Path(directory)
    kind = kind_of(config)
    if draft_vocab is not None:
        if kind != "standalone":
            raise ValueError(f"draft_vocab is recorded for standalone drafters; a {kind} drafter carries its own")
        draft_vocab = checked_vocab_ids(draft_vocab, int(config.vocab_size))
    if kind == "selfspec" and not isinstance(model, SelfSpecAdapter):
        model = adapter_of(model, config)  # an assembled drafter: store its adapter only
    if isinstance(model, EagleHead) and model.config != config:
        raise ValueError("model.config differs from the config being saved")
    full = _stored_state(model)
    shared = {n: d for n, d in (from_target or {}).items() if n in full and tensor_digest(full[n]) == d}
    state = {n: t for n, t in full.items() if n not in shared}
    bad = _non_finite(state)
    if bad:
        raise ValueError(f"refusing to save non-finite weights: {bad}")
    if directory.exists() and not overwrite and any(directory.iterdir()):
        raise FileExistsError(f"{directory} exists and is not empty")
    tmp = directory.with_name(f".{directory.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(state, str(tmp / WEIGHTS_FILE), metadata={"kind": kind, "version": version})
    dtypes = {str(t.dtype).removeprefix("torch.") for t in full.values() if t.is_floating_point()}
    meta = DrafterMeta(
        kind=kind,
        version=version,
        parent_version=parent_version,
        target=fingerprint,
        config=config.model_dump(mode="json"),
        dtype=",".join(sorted(dtypes)),
        files={WEIGHTS_FILE: sha256_file(tmp / WEIGHTS_FILE)},
        extra=dict(extra or {}),
        from_target=shared,
    )
    if isinstance(model, EagleHead):
        meta.draft_vocab_size = int(model.d2t.numel())
        meta.draft_vocab_sha256 = _vocab_hash(model.draft_vocab())
    if draft_vocab is not None:
        save_file({"ids": draft_vocab}, str(tmp / DRAFT_VOCAB_FILE))
        meta.files[DRAFT_VOCAB_FILE] = sha256_file(tmp / DRAFT_VOCAB_FILE)
        meta.draft_vocab_size = int(draft_vocab.numel())
        meta.draft_vocab_sha256 = _vocab_hash(draft_vocab)
    (tmp / CONFIG_FILE).write_text(json.dumps(meta.model_dump(mode="json"), indent=2))
    if directory.exists():
        shutil.rmtree(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, directory)
    return meta


def read_meta(directory: str | Path) -> DrafterMeta:
    """Parse config.json only (no weights, no validation beyond the schema)."""
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise DrafterArtifactError(f"{directory}: no {CONFIG_FILE}")
    try:
        return DrafterMeta.model_validate(json.loads(path.read_text()))
    except (ValidationError, ValueError) as e:  # ValueError: JSON, or bytes that are not UTF-8
        raise DrafterArtifactError(f"{path}: invalid artifact config: {e}") from e


def check_meta(directory: str | Path, meta: DrafterMeta, expected_fingerprint: TargetFingerprint) -> None:
    """What config.json alone can refuse (DrafterArtifactError): another artifact format, or a
    drafter built for another target. ``load_drafter`` runs it first; a command can run it before
    minutes of set-up (infra/artifact_options.py)."""
    if meta.format_version != ARTIFACT_FORMAT_VERSION:
        raise DrafterArtifactError(
            f"{directory}: artifact format {meta.format_version}, expected {ARTIFACT_FORMAT_VERSION}"
        )
    if not meta.target.matches(expected_fingerprint):
        raise DrafterArtifactError(
            f"{directory}: drafter {meta.version} was built for target {meta.target.key()} "
            f"({meta.target.model_dump()}) but this server runs {expected_fingerprint.key()} "
            f"({expected_fingerprint.model_dump()}); refusing to load it"
        )


def load_drafter(
    directory: str | Path,
    expected_fingerprint: TargetFingerprint,
    *,
    device: str | torch.device = "cpu",
    target_tensors: TargetTensors | None = None,
) -> tuple[nn.Module, DrafterMeta]:
    """Validate and load an artifact. An EagleHead comes back without embeddings: attach the
    target's with ``attach_embeddings``. A standalone model trained at a draft vocabulary comes back
    with it as ``model.artifact_draft_vocab`` ([Vd] target ids; None otherwise). Tensors the
    artifact leaves to the target (``DrafterMeta.from_target``) are ``target_tensors``' (shared, not
    copied, where the dtypes agree), each checked against its recorded digest. Raises
    DrafterArtifactError on any problem."""
    directory = Path(directory)
    meta = read_meta(directory)
    check_meta(directory, meta, expected_fingerprint)
    if WEIGHTS_FILE not in meta.files:
        raise DrafterArtifactError(f"{directory}: config lists no checksum for {WEIGHTS_FILE}")
    for name, digest in meta.files.items():
        if name in ("", ".", "..") or Path(name).name != name:
            raise DrafterArtifactError(f"{directory}: {name!r} in config.json is not a file name "
                                       "in the artifact directory")
        path = directory / name
        if not path.is_file():
            raise DrafterArtifactError(f"{directory}: missing file {name}")
        actual = sha256_file(path)
        if actual != digest:
            raise DrafterArtifactError(
                f"{path}: checksum mismatch (sha256 {actual[:12]}…, config says {digest[:12]}…)"
            )
    try:
        cfg = meta.model_cfg()
    except (ValidationError, ValueError) as e:
        raise DrafterArtifactError(f"{directory}: invalid {meta.kind} model config: {e}") from e
    vocab = cfg.target_vocab_size if isinstance(cfg, EagleHeadConfig) else cfg.vocab_size
    if vocab != meta.target.vocab_size:  # the fingerprint pins the target, not the drafter's cut
        raise DrafterArtifactError(
            f"{directory}: drafter {meta.version} drafts over a vocabulary of {vocab} tokens but its "
            f"target has {meta.target.vocab_size}; refusing to load it"
        )
    try:
        state = load_file(str(directory / WEIGHTS_FILE))
    except (SafetensorError, OSError) as e:
        raise DrafterArtifactError(
            f"{directory / WEIGHTS_FILE}: unreadable safetensors: {e}"
        ) from e

    try:
        model = build_model(cfg)
    except Exception as e:  # the constructors' own checks (ZeroDivisionError, ...)
        raise DrafterArtifactError(
            f"{directory}: no {meta.kind} model can be built from its config: {type(e).__name__}: {e}"
        ) from e
    expected = _stored_state(model)
    missing = sorted(set(expected) - set(state) - set(meta.from_target))
    unexpected = sorted(set(state) - set(expected)) + sorted(set(meta.from_target) - set(expected))
    if missing or unexpected:
        raise DrafterArtifactError(
            f"{directory}: tensors missing {missing}, unexpected {unexpected}"
        )
    if both := sorted(set(state) & set(meta.from_target)):
        raise DrafterArtifactError(f"{directory}: tensors {both} both stored and left to the target")
    wrong = [
        f"{n}: {tuple(state[n].shape)} vs config {tuple(expected[n].shape)}"
        for n in state
        if state[n].shape != expected[n].shape
    ]
    if wrong:
        raise DrafterArtifactError(f"{directory}: tensor shapes disagree with the config: {wrong}")
    kinds = [
        n for n, t in state.items() if t.is_floating_point() != expected[n].is_floating_point()
    ]
    if kinds:
        raise DrafterArtifactError(f"{directory}: tensors of the wrong type: {kinds}")
    bad = _non_finite(state)
    if bad:
        raise DrafterArtifactError(f"{directory}: non-finite values (NaN/inf) in {bad}")
    if isinstance(model, EagleHead):
        _check_vocab(directory, meta, cfg, state)
    if isinstance(model, SelfSpecAdapter):
        try:
            check_draft_vocab(cfg, state.get("draft_vocab"))
        except ValueError as e:
            raise DrafterArtifactError(f"{directory}: {e}") from e

    vocab = _standalone_vocab(directory, meta, cfg) if meta.kind == "standalone" else None

    dtype = next((t.dtype for t in state.values() if t.is_floating_point()), None) or _dtype(meta.dtype)
    shared = _target_tensors(directory, meta, expected, dtype, target_tensors)
    model = model.to(dtype)
    model.load_state_dict(state, strict=False)  # completeness checked above; tied aliases follow
    share(model, shared)
    if meta.kind == "standalone":
        model.artifact_draft_vocab = vocab
    return model.to(device).eval(), meta


def _dtype(names: str) -> torch.dtype:
    """The artifact's floating dtype from ``DrafterMeta.dtype`` (float32 where it names none)."""
    dtype = getattr(torch, names.split(",")[0], None) if names else None
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def _target_tensors(directory: Path, meta: DrafterMeta, expected: dict[str, torch.Tensor], dtype: torch.dtype,
                    target: TargetTensors | None) -> dict[str, torch.Tensor]:
    """The target's tensors for the names the artifact left to it, each checked against the
    artifact's shape and digest."""
    if not meta.from_target:
        return {}
    if target is None:
        raise DrafterArtifactError(f"{directory}: drafter {meta.version} shares {sorted(meta.from_target)} "
                                   "with its target; load it with the target's tensors")
    out = {}
    for name, digest in meta.from_target.items():
        t = target.get(name, dtype)
        if t is None or t.shape != expected[name].shape:
            found = "no such tensor" if t is None else f"shape {tuple(t.shape)}"
            raise DrafterArtifactError(f"{directory}: drafter {meta.version} takes {name} "
                                       f"{tuple(expected[name].shape)} from its target, which has {found}")
        if target.digest(name, dtype) != digest:
            raise DrafterArtifactError(
                f"{directory}: drafter {meta.version} was cut from a target whose {name} differs from "
                f"this server's (same fingerprint {meta.target.key()}, other weights); refusing to load it")
        out[name] = t
    return out


def _standalone_vocab(directory: Path, meta: DrafterMeta, cfg) -> torch.Tensor | None:
    """The recorded draft vocabulary of a standalone artifact, checked against config.json."""
    recorded = meta.draft_vocab_size is not None or meta.draft_vocab_sha256 is not None
    if DRAFT_VOCAB_FILE not in meta.files:
        if recorded:
            raise DrafterArtifactError(f"{directory}: config.json records a draft vocabulary but "
                                       f"lists no {DRAFT_VOCAB_FILE}")
        return None
    try:
        ids = checked_vocab_ids(load_file(str(directory / DRAFT_VOCAB_FILE))["ids"], int(cfg.vocab_size))
    except (SafetensorError, OSError, KeyError, ValueError) as e:
        raise DrafterArtifactError(f"{directory / DRAFT_VOCAB_FILE}: {e}") from e
    if meta.draft_vocab_size != ids.numel() or meta.draft_vocab_sha256 != _vocab_hash(ids):
        raise DrafterArtifactError(
            f"{directory}: draft vocabulary differs from the one recorded in config.json"
        )
    return ids


def _check_vocab(directory: Path, meta: DrafterMeta, cfg, state: dict[str, torch.Tensor]) -> None:
    d2t, t2d = state["d2t"].to(torch.long), state["t2d"].to(torch.bool)
    ids = torch.arange(d2t.numel()) + d2t  # [Vd] target ids
    try:
        checked_vocab_ids(ids, cfg.target_vocab_size)
    except ValueError as e:
        raise DrafterArtifactError(f"{directory}: d2t does not map to a draft vocabulary: {e}") from e
    if int(t2d.sum()) != ids.numel() or not bool(t2d[ids].all()):
        raise DrafterArtifactError(f"{directory}: t2d disagrees with d2t")
    if meta.draft_vocab_size is not None and meta.draft_vocab_size != ids.numel():
        raise DrafterArtifactError(
            f"{directory}: draft_vocab_size {meta.draft_vocab_size} but d2t has {ids.numel()}"
        )
    if meta.draft_vocab_sha256 is not None and meta.draft_vocab_sha256 != _vocab_hash(ids):
        raise DrafterArtifactError(
            f"{directory}: draft vocabulary differs from the one recorded in config.json"
        )
