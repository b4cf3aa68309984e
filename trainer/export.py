"""Student -> drafter artifact directory (feedback/registry/artifact.py format), for the registry."""

from __future__ import annotations

from pathlib import Path

from feedback.target.fingerprint import TargetFingerprint


def artifact_exporter(config=None, version_prefix: str = "cand"):
    """Exporter for TrainerLoop: writes ``student.model`` with its drafter ``config``
    (StandaloneConfig, or None for an EagleHead, which carries its own) and, for a standalone
    student read at a draft vocabulary, that vocabulary, without the tensors it keeps as the
    target's (``student.from_target``), via
    ``feedback.registry.artifact.save_drafter``."""
    from feedback.registry.artifact import save_drafter

    counter = {"n": 0}

    def export(student, out_dir: Path, fingerprint: TargetFingerprint, extra: dict | None = None) -> None:
        counter["n"] += 1
        cfg = config if config is not None else student.model.config
        save_drafter(student.model, cfg, fingerprint, out_dir, version=f"{version_prefix}-{counter['n']}",
                     overwrite=True, draft_vocab=student_draft_vocab(student), extra=extra,
                     from_target=getattr(student, "from_target", None))

    return export


def student_draft_vocab(student):
    """The [Vd] target ids a standalone student's lm_head is read at (None: the whole vocabulary,
    or a kind that carries its own draft vocabulary), for the artifact to record."""
    return getattr(student, "head_vocab", None) if getattr(student, "kind", None) == "standalone" else None
