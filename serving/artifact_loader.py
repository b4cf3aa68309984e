"""Drafter artifact directory -> a validated drafter of the kind this server serves (the loader
the Swapper installs from)."""

from __future__ import annotations

from pathlib import Path


class DrafterKindMismatch(ValueError):
    """A promoted artifact is of another drafter kind than the one this server serves."""


class ArtifactDrafterLoader:
    """Builds a validated drafter from an artifact directory for a loaded target.

    ``kind="hybrid"`` (or ``"suffix"``, the same serve path): a hybrid around the artifact's learned
    model that keeps the running suffix drafter (and so its index): the running hybrid's, or the
    running drafter itself when it is a suffix drafter (a suffix-only day 0 that turns hybrid at its
    first promotion) -- what the trainer's gate simulates. Otherwise the artifact must be of
    ``kind`` (DrafterKindMismatch, naming both, if not). ``options`` go to ``build_drafter``.

    A loader's ``load(artifact_dir, current)`` must read what it needs into memory: the Swapper
    deletes ``artifact_dir`` (its download) once ``load`` returns."""

    def __init__(self, target, kind: str = "hybrid", options: dict | None = None):
        self.target, self.kind, self.options = target, kind, dict(options or {})

    def load(self, artifact_dir: Path, current=None):
        from feedback.registry.artifact import read_meta
        from serving.drafters.factory import build_drafter

        meta = read_meta(artifact_dir)  # DrafterArtifactError when absent or malformed
        if self.kind not in ("hybrid", "suffix") and meta.kind != self.kind:
            raise DrafterKindMismatch(
                f"artifact {meta.version!r} is a {meta.kind!r} drafter but this server serves "
                f"{self.kind!r} drafters (SPECLOOP_DRAFTER={self.kind}); train and serve one kind: "
                "the trainer follows SPECLOOP_DRAFTER too")
        if self.kind in ("hybrid", "suffix"):  # what the trainer's gate judged: suffix + learned
            suffix = current if getattr(current, "kind", None) == "suffix" else getattr(current, "suffix", None)
            # the running suffix drafter too: a day-0 hybrid is the suffix index alone, and its first
            # promotion keeps the index whose drafts serving's estimate was built on
            predecessor = current if getattr(current, "kind", None) in ("hybrid", "suffix") else None
            return build_drafter("hybrid", self.target, artifact_dir, suffix=suffix, predecessor=predecessor,
                                 **self.options)
        return build_drafter(meta.kind, self.target, artifact_dir, **self.options)
