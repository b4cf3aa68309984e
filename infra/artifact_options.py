"""A drafter artifact given as an option (``bench spec --artifact``, ``--day0-artifact`` of ``demo``
and ``bench online``): checked from its config.json alone (no weights read) before the target
loads, and against the target's fingerprint once it has, before the suffix seed, the baseline or any
service starts. They were read only where the drafter was built, minutes in, and a bad one ended in
a traceback."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import typer

if TYPE_CHECKING:
    from feedback.registry.artifact import DrafterMeta
    from feedback.target.fingerprint import TargetFingerprint

LEARNED_KINDS = ("eagle", "standalone", "selfspec")
"""The artifact kinds ``specloop train`` and the trainer publish."""


def refuse(option: str, why: str) -> NoReturn:
    """A usage error (exit 2) naming ``option``, in one line."""
    raise typer.BadParameter(" ".join(why.split()), param_hint=option)


def artifact_meta(path: str | Path, option: str, kinds: tuple[str, ...], use: str) -> DrafterMeta:
    """``path``'s config.json when it is a drafter artifact of one of ``kinds``, else a usage error
    naming ``option``. ``use``: what the command serves, said when the artifact is of another kind."""
    from feedback.registry.artifact import DrafterArtifactError, read_meta

    path = Path(path)
    if not path.is_dir():
        refuse(option, f"{path}: {'not a directory' if path.exists() else 'no such directory'}")
    try:
        meta = read_meta(path)
    except (DrafterArtifactError, OSError) as exc:  # OSError: a config.json that cannot be read
        refuse(option, _one_line(exc))
    if meta.kind not in kinds:
        refuse(option, f"{path} is a {meta.kind} drafter; {use}")
    return meta


DAY0_OPTION = "--day0-artifact"


def day0_artifact_meta(path: str | Path | None) -> DrafterMeta | None:
    """``--day0-artifact`` (demo, bench online), before the target loads: a selfspec artifact (the
    loop starts its learned drafter from one whatever ``--learned`` says: infra/day0.py's
    ``learned_kind``). Its config.json, or None without one."""
    if path is None:
        return None
    return artifact_meta(path, DAY0_OPTION, ("selfspec",), "the learned drafter starts from a selfspec "
                         "artifact (`specloop train` with SPECLOOP_TRAINER_DRAFTER=selfspec)")


def check_target(meta: DrafterMeta, path: str | Path, option: str, fingerprint: TargetFingerprint) -> None:
    """Once the target has loaded: what ``load_drafter`` checks from config.json when the drafter
    is built, later (its format, built for this target)."""
    from feedback.registry.artifact import DrafterArtifactError, check_meta

    try:
        check_meta(path, meta, fingerprint)
    except DrafterArtifactError as exc:
        refuse(option, str(exc))


def _one_line(exc: BaseException) -> str:
    """``read_meta``'s message with a schema error's first line only (pydantic's run over many)."""
    from pydantic import ValidationError

    from feedback.pydantic_errors import first_error

    text, cause = str(exc), exc.__cause__
    if isinstance(cause, ValidationError) and str(cause) in text:
        text = text.replace(str(cause), first_error(cause))
    return text
