"""Writes the suffix seed (feedback/suffix/seed.py): the target's greedy answers to code and chat
requests written from the installed packages (trainer/package_prompts.py), answered by serving's
engine (infra/offline_generation.py) and cached per target and recipe.

``specloop suffix-seed`` writes one; ``specloop demo``, ``bench online`` and ``bench spec`` build theirs
here (``--suffix-seed N``, once per machine: ~6 minutes for 640 + 640 answers on two cores) and
point ``SPECLOOP_SUFFIX_SEED_FILE`` at it, which serving's suffix drafter and the trainer's gate
read alike. Heavy imports stay inside the functions."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import typer

log = logging.getLogger(__name__)

DEFAULT_CACHE = Path.home() / ".cache" / "specloop" / "suffix-seed"
SEED_ENV = "SPECLOOP_SUFFIX_SEED_FILE"


DEFAULT_REQUESTS = 640
"""What ``make pretrain`` answers (``specloop train --requests 640 --max-new-tokens 96``): the two
share the answers cache. Measured: 640 + 640 answers (~103 k tokens) drafted more than 160 + 160
on every prompt set tried (ARCHITECTURE.md, "A suffix index that knows the target")."""


def seed_option():
    """``--suffix-seed N``, as demo and the benchmarks take it."""
    return typer.Option(DEFAULT_REQUESTS, "--suffix-seed", min=0,
                        help="Start every suffix index from the target's answers to N code and N chat requests "
                        "written from the installed packages (written once per machine and cached; "
                        "`specloop suffix-seed`); 0: indexes start empty.")


def model_option():
    """``--model``, as suffix-seed and demo take it (``load_model_option``)."""
    return typer.Option(None, help="Target: a Hugging Face directory or the default's name "
                        "(default: SPECLOOP_MODEL, else SmolLM2-135M-Instruct).")


def load_model_option(model: str | None):
    """The target ``specloop serve`` would serve: ``model`` (``--model``), else the settings'
    (SPECLOOP_MODEL). A bad setting, or a model that does not exist, is a usage error in one line."""
    from infra.root import cli_settings
    from serving.target import load_target

    model = cli_settings(serving={"model": model} if model else {}).serving.model
    try:
        return load_target(model)
    except FileNotFoundError as e:  # a typo: one line naming the option, not a traceback
        raise typer.BadParameter(str(e), param_hint="--model") from None


def current_seed() -> Path | None:
    """The seed file this process's suffix settings point at (``SPECLOOP_SUFFIX_SEED_FILE``)."""
    value = os.environ.get(SEED_ENV)
    return Path(value) if value else None


def seed_summary(path: Path | None) -> dict | None:
    """What a run's JSON says about its seed (None: no seed)."""
    if path is None:
        return None
    from feedback.suffix.seed import read_seed

    seed = read_seed(path)
    return {"file": str(path), "sequences": len(seed.sequences), "tokens": seed.num_tokens, "source": seed.source}


def seed_path(fingerprint, requests: int, seed: int, max_new_tokens: int, cache_dir: Path = DEFAULT_CACHE) -> Path:
    return Path(cache_dir) / f"{fingerprint.key()}-r{requests}-s{seed}-t{max_new_tokens}.json"


def ensure_suffix_seed(target, requests: int = DEFAULT_REQUESTS, *, seed: int = 0, max_new_tokens: int = 96,
                       cache_dir: Path = DEFAULT_CACHE, out: Path | None = None,
                       answers_cache: Path | None = None) -> Path:
    """The seed file for ``target`` (serving.target.Target): read back from ``cache_dir`` if this
    recipe was written before, else from the target's answers (``answers_cache``, default the
    trainer's corpus cache; answered now on the engine where missing) and written."""
    from feedback.suffix.seed import SuffixSeed, SuffixSeedError, read_seed, write_seed

    path = Path(out) if out is not None else seed_path(target.fingerprint, requests, seed, max_new_tokens, cache_dir)
    if path.exists():
        try:
            read_seed(path, target.fingerprint)  # refuses a broken file or another target's
            return path
        except SuffixSeedError as e:
            if out is not None:
                raise  # the user's file: theirs to mend
            log.warning("%s: writing it again", e)  # the cache's own (e.g. cut short by a full disk)
    import torch

    from infra.offline_generation import engine_generator
    from trainer.cli import CORPUS_CACHE
    from trainer.offline import OfflinePrompt, cached_generated_traces, chat_ids
    from trainer.package_prompts import package_requests

    # the answers `specloop train --requests N` (make pretrain) distils on, from the same cache
    answers_cache = CORPUS_CACHE if answers_cache is None else answers_cache
    prompts = [OfflinePrompt(chat_ids(target.tokenizer, r.messages), r.domain)
               for r in package_requests(requests, seed=seed)]
    generate = engine_generator(target.model, target.tokenizer, target.fingerprint)
    threads = torch.get_num_threads()  # the demo and the benchmarks serve on one core; this runs first
    torch.set_num_threads(max(threads, len(os.sched_getaffinity(0))))
    try:
        traces = cached_generated_traces(generate, target.fingerprint, prompts, answers_cache,
                                         max_new_tokens=max_new_tokens)
    finally:
        torch.set_num_threads(threads)
    source = f"package requests: {requests} code + {requests} chat, seed {seed}, {max_new_tokens} tokens, greedy"
    return write_seed(path, SuffixSeed(fingerprint=target.fingerprint, source=source,
                                       sequences=[t.output_ids.tolist() for t in traces]))


def use_suffix_seed(target, requests: int, **kwargs) -> Path | None:
    """Build (or find) the seed and point this process's suffix settings at it, for everything
    started after (serving's suffix drafter, the trainer's gate, its Ray workers). ``requests`` 0:
    no seed, and an inherited ``SPECLOOP_SUFFIX_SEED_FILE`` is cleared. Returns the file."""
    if requests <= 0:
        os.environ.pop(SEED_ENV, None)
        return None
    path = ensure_suffix_seed(target, requests, **kwargs)
    os.environ[SEED_ENV] = str(path)
    return path


def cmd_suffix_seed(
    model: str | None = model_option(),
    requests: int = typer.Option(DEFAULT_REQUESTS, min=1, help="Code and as many chat requests written from the installed "
                                 "packages for the target to answer."),
    seed: int = typer.Option(0, help="Which package requests (trainer/package_prompts.py)."),
    max_new_tokens: int = typer.Option(96, min=1, help="Tokens per answer."),
    out: Path | None = typer.Option(None, help="Where to write it (default: the cache demo and bench use)."),
) -> None:
    """Write a suffix seed: the target's own answers, which every tenant's suffix index starts with.
    Serve the same target with it: SPECLOOP_SUFFIX_SEED_FILE=PATH specloop serve ..."""
    target = load_model_option(model)  # what `specloop serve` would serve
    path = ensure_suffix_seed(target, requests, seed=seed, max_new_tokens=max_new_tokens, out=out)
    typer.echo(str(path))
