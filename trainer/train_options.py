"""``specloop train``'s options, checked before any work (trainer/cli.py): ``--out`` must be safe to
replace, online training refuses the options only an offline run uses, and an offline run the one
only online training uses."""

from __future__ import annotations

import os
from pathlib import Path

import typer

OFFLINE_ONLY = ("out", "steps", "max_new_tokens", "model_id", "corpus_cache")
"""``train``'s parameters that only ``run_offline`` reads: online training ignored them silently."""
ONLINE_ONLY = ("rounds",)
"""...and the one only the online trainer reads: an offline run ignored it silently."""

EXPLICIT = ("COMMANDLINE", "ENVIRONMENT")
"""The ParameterSource members of a value the user gave, by name: typer 0.29 carries its own copy of
click (``typer._click``), whose enum is not ``click.core.ParameterSource``."""


def refuse_mode_options(ctx: typer.Context, offline: bool) -> None:
    """Any option of the other mode (OFFLINE_ONLY online, ONLINE_ONLY offline) given on the command
    line (or from an environment variable) is a usage error naming it, before the model loads or Ray
    starts. "Given" is click's parameter source, not a comparison with the default: ``--steps 400``
    is refused too."""
    names = ONLINE_ONLY if offline else OFFLINE_ONLY
    given = [p.opts[0] for p in ctx.command.params if p.name in names
             and getattr(ctx.get_parameter_source(p.name), "name", None) in EXPLICIT]
    if not given:
        return
    them = "them" if len(given) > 1 else "it"
    if offline:
        raise typer.BadParameter(f"{', '.join(given)}: only for online training; an --offline/--corpus/"
                                 f"--requests run trains once and does not use {them}")
    raise typer.BadParameter(f"{', '.join(given)}: only for --offline/--corpus/--requests (train once, "
                             f"offline); online training does not use {them}")


def check_out(out: Path) -> None:
    """Before any work: ``--out`` is deleted and replaced by the new artifact at the end
    (``save_drafter(overwrite=True)``), so it must be a new path, an empty directory, or a drafter
    artifact already; anything else (a folder of other files, a file, ``.``) is refused."""
    from feedback.registry.artifact import CONFIG_FILE, DrafterArtifactError, read_meta

    def refuse(why: str):
        raise typer.BadParameter(f"{out}: {why}", param_hint="'--out'")

    if out.name in ("", ".", ".."):
        refuse("name the artifact directory itself (e.g. --out ./my-drafter): it is deleted and rewritten")
    if out.is_symlink():
        refuse("a symbolic link; give the artifact directory itself")
    if out.is_dir():
        try:
            empty = not any(out.iterdir())
        except OSError as exc:
            refuse(f"cannot be read ({exc.strerror or exc})")
        if not empty:
            try:
                read_meta(out)
            except DrafterArtifactError:
                refuse(f"a directory that is not a drafter artifact (no valid {CONFIG_FILE}); it would be "
                       "deleted and replaced by the new artifact: give a new or empty directory")
    elif out.exists():
        refuse("exists and is not a directory (the artifact is a directory): give a new path")
    parent = next((p for p in out.absolute().parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        refuse(f"cannot be created: {parent} is not a directory")
    if parent is not None and not os.access(parent, os.W_OK | os.X_OK):
        refuse(f"cannot be written: {parent} is not writable")
