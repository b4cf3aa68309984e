"""``specloop train``: run the trainer actor until interrupted (settings: trainer/config.py)."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from pathlib import Path

import typer

from feedback.drafters.defaults import (
    SELFSPEC_ADAPTER_LAYERS,
    SELFSPEC_DRAFT_VOCAB_SIZE,
    SELFSPEC_EXIT_LAYER,
)


def _default_loader(overrides: dict):
    from trainer.config import TrainerSettings

    return TrainerSettings(**overrides)


_loader = _default_loader
log = logging.getLogger(__name__)

CORPUS_CACHE = Path.home() / ".cache" / "specloop" / "corpus"


def use_settings(loader) -> None:
    """Where ``specloop train`` gets its settings: ``loader(overrides) -> TrainerSettings``. The
    ``specloop`` CLI installs infra's settings tree (infra/root.py) here."""
    global _loader
    _loader = loader


class InputError(ValueError):
    """A mistake in what ``specloop train`` was given (settings, the model, a prompt file, where to
    write): the command prints it as one line and exits 1, where a bug keeps its traceback."""


def _settings(**overrides):
    try:
        return _loader(overrides)
    except ValueError as exc:  # pydantic's ValidationError, pydantic-settings' SettingsError
        raise InputError(f"settings: {_one_line(exc)}") from exc


def _one_line(exc: BaseException) -> str:
    from pydantic import ValidationError

    from feedback.pydantic_errors import SETTINGS_ERRORS, first_error, first_settings_error

    if isinstance(exc, SETTINGS_ERRORS):
        return first_settings_error(exc)
    text = str(exc)
    cause = exc.__cause__
    if isinstance(cause, ValidationError) and str(cause) in text:  # e.g. read_meta's "invalid artifact config"
        text = text.replace(str(cause), first_error(cause))
    return " ".join(text.split()) or type(exc).__name__


@contextlib.contextmanager
def _input(*types: type[BaseException], about: object = None):
    """Inside: ``types`` raised are a mistake in the input (an InputError, one line; ``about``
    names what was given where the message does not)."""
    try:
        yield
    except InputError:
        raise
    except types as exc:
        text = _one_line(exc)
        raise InputError(text if about is None or str(about) in text else f"{about}: {text}") from exc


_generator = None
"""``use_generator``'s factory; None: the trainer's own (``trainer.offline.hf_generator``)."""


def use_generator(factory) -> None:
    """How ``specloop train --offline/--requests`` has the target answer its prompts:
    ``factory(hf_model, tokenizer, fingerprint) -> ResponseGenerator`` (trainer/offline.py). The
    trainer's own is Hugging Face's ``generate``; the ``specloop`` CLI installs serving's engine
    (infra/offline_generation.py)."""
    global _generator
    _generator = factory


def make_student(model: str, kind: str, max_len: int, exit_layer: int = SELFSPEC_EXIT_LAYER,
                 draft_vocab_size: int | None = SELFSPEC_DRAFT_VOCAB_SIZE, adapter_layers: int = SELFSPEC_ADAPTER_LAYERS,
                 *, init=None, served_day0: str | None = None, target=None, fingerprint=None):
    """Build the day-0 student from the target directory. Runs inside the Ray worker, so no model
    weights travel through the object store (on a cluster the path must exist on the worker).
    ``init``: start from this selfspec adapter instead: ``load_drafter``'s, already checked against
    the target (``run_offline`` reads the artifact once, before minutes of generation), or an
    artifact directory, read here against ``fingerprint`` (the online trainer: in the worker).
    ``served_day0``: a standalone student starts as this served day-0 draft (its directory).
    ``target``: the target's Hugging Face model, already loaded from ``model`` in float32
    (``run_offline``'s, which answered the prompts); None: loaded here."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from feedback.drafters.eagle_head import eagle_from_target
    from feedback.drafters.from_target import assemble, selfspec_adapter_from_target
    from feedback.drafters.standalone_lm import standalone_from_target
    from feedback.drafters.vocab import day0_draft_vocab, special_token_ids
    from trainer.eagle_student import EagleStudent
    from trainer.students import (
        SelfSpecStudent,
        StandaloneStudent,
        selfspec_student_from_adapter,
        selfspec_student_from_artifact,
    )

    if target is None:
        target = AutoModelForCausalLM.from_pretrained(model)
    if init is not None:
        if kind != "selfspec":
            raise ValueError(f"init: only a selfspec student starts from an artifact, not {kind}")
        if isinstance(init, (str, Path)):
            return selfspec_student_from_artifact(init, target.float(), fingerprint, max_len)
        return selfspec_student_from_adapter(init, target.float(), max_len)
    if kind == "eagle":
        return EagleStudent(eagle_from_target(target), max_len=max_len)
    if kind == "selfspec":
        target = target.float()
        vocab = None
        if draft_vocab_size is not None:
            specials = special_token_ids(AutoTokenizer.from_pretrained(model), target.config)
            vocab = day0_draft_vocab(int(target.config.vocab_size), draft_vocab_size, specials)
        adapter = selfspec_adapter_from_target(target, exit_layer=exit_layer, adapter_layers=adapter_layers,
                                               draft_vocab=vocab)
        return SelfSpecStudent(assemble(adapter, target), adapter.config, max_len)
    if served_day0 is not None:
        from feedback.drafters.standalone_lm import load_served_standalone

        return StandaloneStudent(load_served_standalone(served_day0, target).float(), max_len)
    return StandaloneStudent(standalone_from_target(target).float(), max_len)


def _init_meta(init: Path, settings):
    """``--init``'s config.json, checked before any weights load (the target's, the artifact's):
    a selfspec artifact, for a selfspec trainer."""
    from feedback.registry.artifact import DrafterArtifactError, read_meta

    if settings.drafter != "selfspec":
        raise typer.BadParameter(f"--init starts a selfspec drafter, not {settings.drafter}; "
                                 "set SPECLOOP_TRAINER_DRAFTER=selfspec")
    with _input(DrafterArtifactError, OSError, about="--init"):  # no readable config.json
        meta = read_meta(init)
    if meta.kind != settings.drafter:
        raise DrafterArtifactError(f"{init}: a {meta.kind} drafter artifact; --init needs a {settings.drafter} one")
    return meta


def _serves_init(settings, init: Path | None) -> bool:
    """Serving starts with ``--init`` itself (SPECLOOP_DRAFTER_DIR is that directory)."""
    day0 = settings.day0_drafter_dir
    return init is not None and day0 is not None and Path(day0).resolve() == Path(init).resolve()


def served_day0_draft(settings, init: Path | None = None) -> str | None:
    """The day-0 draft serving starts with, where the trainer can start from it: a standalone
    student (the kind SGLang's STANDALONE serves). An EAGLE head or a selfspec adapter starts from
    the target as before (the day-0 dir then holds another kind's weights), or from ``init``
    (``--init``, a selfspec artifact), which may be that very directory."""
    day0 = settings.day0_drafter_dir
    if day0 is None or settings.drafter != "standalone":
        if _serves_init(settings, init):
            log.info("day-0 drafter %s: the %s student starts from it (--init)", day0, settings.drafter)
        elif day0 is not None:
            log.info("day-0 drafter %s: a %s student starts from %s, not from it", day0, settings.drafter,
                     "the target" if init is None else f"--init {init}")
        return None
    return day0


def train(
    ctx: typer.Context,
    model: str | None = typer.Option(None, help="Target the drafter is trained for: a Hugging Face directory or "
                                     "the default's name (default: SPECLOOP_MODEL, else SmolLM2-135M-Instruct)."),
    rounds: int = typer.Option(0, min=0, help="Online: stop after this many rounds (0 = run until interrupted)."),
    offline: Path | None = typer.Option(None, exists=True, dir_okay=False,
                                        help="Train once, offline, on the target's own responses to "
                                        "these prompts (JSONL: messages or prompt, optional domain); no Kafka/Ray."),
    corpus: int = typer.Option(0, min=0, help="Train once, offline, on this many code and as many prose chunks of "
                               "text from the installed packages, teacher-forced through the target "
                               "(trainer/corpus.py); alone or with --offline."),
    requests: int = typer.Option(0, min=0, help="Train once, offline, on the target's own answers to this many "
                                 "code and as many chat requests written from the installed packages "
                                 "(trainer/package_prompts.py); alone or with --corpus/--offline."),
    init: Path | None = typer.Option(None, exists=True, file_okay=False,
                                     help="Start from this selfspec drafter artifact (same target; "
                                     "SPECLOOP_TRAINER_DRAFTER=selfspec) instead of the day-0 drafter, "
                                     "offline or online."),
    corpus_cache: Path = typer.Option(CORPUS_CACHE, help="--corpus/--requests/--offline: where "
                                      "teacher-forced and generated traces are kept between runs."),
    out: Path = typer.Option(Path("specloop-static-drafter"), help="--offline/--corpus/--requests: artifact "
                             "directory written: a new path, an empty directory or an earlier artifact "
                             "(replaced); anything else is refused."),
    model_id: str | None = typer.Option(None, help="--offline: target id in the fingerprint (default: the directory "
                                        "name; serving's default target is SmolLM2-135M-Instruct)."),
    max_new_tokens: int = typer.Option(64, min=1, help="--offline/--requests: tokens generated per prompt."),
    steps: int = typer.Option(400, min=1, help="--offline/--corpus/--requests: most training steps (early stop on "
                              "held-out acceptance)."),
) -> None:
    """Consume traces, distil the drafter, gate, register and announce promotions; with
    ``--offline`` train a static drafter once from prompts and save (and register) it."""
    from feedback.registry.artifact import DrafterArtifactError
    from trainer.train_options import check_out, refuse_mode_options

    once = offline is not None or corpus > 0 or requests > 0
    refuse_mode_options(ctx, offline=once)  # the other mode's options would be ignored
    if once:
        check_out(out)
    try:
        _train(model, rounds, offline, corpus, requests, init, corpus_cache, out, model_id, max_new_tokens, steps)
    except (InputError, DrafterArtifactError) as exc:  # a mistake in the input; anything else is a bug
        log.debug("specloop train refused its input", exc_info=True)
        typer.echo(f"Error: {_one_line(exc)}", err=True)
        raise typer.Exit(1) from None


def _train(model, rounds, offline, corpus, requests, init, corpus_cache, out, model_id, max_new_tokens,
           steps) -> None:
    import json

    model = model or _settings().model
    if offline is not None or corpus > 0 or requests > 0:
        print(json.dumps(run_offline(model, offline, out, model_id, max_new_tokens, steps, corpus=corpus,
                                     requests=requests, init=init, corpus_cache=corpus_cache)))
        return

    from transformers import AutoConfig

    from feedback.drafters.standalone_lm import StandaloneConfig
    from feedback.registry.artifact import DrafterArtifactError
    from feedback.registry.artifact_keys import DAY0_VERSION
    from feedback.target.location import model_fingerprint
    from trainer.actor import start_actor
    from trainer.device import resolve_device
    from trainer.export import artifact_exporter

    settings = _settings()
    init_meta = _init_meta(init, settings) if init is not None else None
    with _input(ValueError):
        resolve_device(settings.device)  # a cuda setting without a GPU, before the model and Ray start
    with _input(OSError, ValueError):  # a missing model, or one this drafter does not fit
        path, fp = model_fingerprint(model)  # the same fingerprint serving gives this target's traces
        model = str(path)
        config = AutoConfig.from_pretrained(model)
        export_cfg = StandaloneConfig.for_target(config) if settings.drafter == "standalone" else None
        if settings.drafter == "selfspec":
            from feedback.drafters.from_target import SelfSpecConfig

            export_cfg = SelfSpecConfig.for_target(config, settings.exit_layer, settings.adapter_layers,
                                                   draft_vocab_size=settings.draft_vocab_size)
    if init is not None:
        from feedback.registry.artifact import check_meta

        with _input(DrafterArtifactError, about="--init"):  # another target's: before Ray starts
            check_meta(init, init_meta, fp)
    served_day0 = served_day0_draft(settings, init)
    # Serving runs its day-0 draft as version "day0": the first candidate must beat it, not nothing.
    champion = DAY0_VERSION if served_day0 is not None else None
    if _serves_init(settings, init):
        champion = init_meta.version  # serving starts with it too: candidates must beat it
    factory = functools.partial(make_student, model, settings.drafter, settings.max_len,
                                settings.exit_layer, settings.draft_vocab_size, settings.adapter_layers,
                                served_day0=served_day0, init=init, fingerprint=fp)
    actor = start_actor(settings, factory, fp, exporter=artifact_exporter(export_cfg), initial_champion=champion)
    import ray

    try:
        print(json.dumps(ray.get(actor.run.remote(rounds or None))))
    except KeyboardInterrupt:
        ray.get(actor.stop.remote())
    finally:
        ray.shutdown()


def run_offline(model: str | None, prompts: Path | None, out: Path, model_id: str | None, max_new_tokens: int,
                steps: int, *, corpus: int = 0, requests: int = 0, init: Path | None = None,
                corpus_cache: Path | None = None) -> dict:
    """``specloop train --offline/--corpus/--requests``: generate and trace the target's responses
    to ``prompts`` and to ``requests`` code and chat requests written from the installed packages,
    and/or teacher-force ``corpus`` chunks per domain of package text, distil
    (trainer/offline.py), save; register in MLflow as the tenant's champion when
    SPECLOOP_TRAINER_TRACKING_URI is set explicitly."""
    import time

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from feedback.registry.artifact import DrafterArtifactError, load_drafter, save_drafter
    from feedback.target.location import model_fingerprint
    from trainer.device import resolve_device
    from trainer.export import student_draft_vocab
    from trainer.offline import (
        OfflinePrompt,
        cached_corpus_traces,
        cached_generated_traces,
        chat_ids,
        hf_generator,
        read_prompts,
        train_offline,
    )

    settings = _settings()
    if init is not None:  # before minutes of generation and training
        _init_meta(init, settings)
    with _input(ValueError):
        device = resolve_device(settings.device)
    t0 = time.perf_counter()
    with _input(OSError, ValueError):  # a missing model directory, or one that is not a model
        path, fp = model_fingerprint(model)
        model = str(path)
        tok = AutoTokenizer.from_pretrained(model)
    if model_id:
        fp = fp.model_copy(update={"model_id": model_id})
    adapter = None
    if init is not None:  # validated as serving validates it (its target, checksums, shapes); read once
        with _input(DrafterArtifactError, OSError, about="--init"):
            adapter, _ = load_drafter(init, fp)
    with _input(OSError, ValueError, about=prompts):  # a bad row names its line
        items = read_prompts(prompts, tok) if prompts is not None else []
    with _input(OSError):  # a model directory without weights
        target = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    if requests > 0:
        from trainer.package_prompts import package_requests

        items += [OfflinePrompt(chat_ids(tok, r.messages), r.domain) for r in package_requests(requests)]
    records = cached_generated_traces((_generator or hf_generator)(target, tok, fp), fp, items, corpus_cache,
                                      max_new_tokens=max_new_tokens, tenant=settings.tenant) if items else []
    if corpus > 0:
        from rich.console import Console
        from rich.progress import Progress

        from trainer.corpus import package_corpus

        chunks = package_corpus(tok, corpus)
        with Progress(console=Console(stderr=True), transient=True) as bar:  # stdout stays one JSON object
            task = bar.add_task("teacher-forcing package text", total=len(chunks))
            records += cached_corpus_traces(target, fp, chunks, corpus_cache, tenant=settings.tenant,
                                            progress=lambda n: bar.advance(task, n))
    gen_s = time.perf_counter() - t0
    student = make_student(model, settings.drafter, settings.max_len, settings.exit_layer,  # the target loaded once
                           settings.draft_vocab_size, settings.adapter_layers, init=adapter, target=target)
    student.to(device)
    fit = train_offline(student, records, fp, max_steps=steps, k=settings.k, distill=settings.distill_config())
    config = getattr(student, "config", None) or (student.model.config if settings.drafter == "eagle" else None)
    if config is None:
        from feedback.drafters.standalone_lm import StandaloneConfig

        config = StandaloneConfig.for_target(student.model.config)
    version = f"static-{int(time.time())}"
    with _input(OSError, about=out):  # a full disk, a directory made read-only meanwhile
        save_drafter(student.model, config, fp, out, version=version, overwrite=True,
                     draft_vocab=student_draft_vocab(student), from_target=getattr(student, "from_target", None),
                     extra={"offline_prompts": str(prompts), "corpus_chunks_per_domain": corpus,
                            "package_requests_per_domain": requests, "init": str(init),
                            **{k: v for k, v in fit.items() if k != "stopped_early"}})
    result = {"artifact": str(out), "version": version, "drafter": settings.drafter, "prompts": len(items),
              "package_requests": 2 * requests, "corpus_chunks": 2 * corpus, "init": str(init) if init else None,
              "generation_s": gen_s, **fit}
    if {"SPECLOOP_TRAINER_TRACKING_URI", "SPECLOOP_MLFLOW_TRACKING_URI"} & set(os.environ):
        from feedback.registry.drafter_registry import DrafterRegistry

        reg = DrafterRegistry(settings.tracking_uri)
        run_id = reg.log_candidate(fp, out, params={"offline_prompts": str(prompts), "drafter": settings.drafter},
                                   metrics={"heldout_acceptance": fit["heldout_acceptance"]},
                                   tags={"origin": "offline"})
        result["registered"] = reg.register(settings.tenant, run_id, description="offline static drafter").version
    return result
