"""``specloop serve`` and ``specloop generate``.

Options left unset fall back to ``SPECLOOP_*`` environment variables, then to ServingSettings'
defaults; the settings come from infra's settings tree when run as ``specloop`` (``use_settings``). Heavy modules (torch, the engine, uvicorn) are imported inside the commands so
``specloop --help`` stays fast.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer

from feedback.pydantic_errors import SETTINGS_ERRORS, first_error, first_settings_error

log = logging.getLogger(__name__)

_MODEL = typer.Option(help="Target: SmolLM2-135M-Instruct (default) or a Hugging Face model dir.")
_DRAFTER = typer.Option(help="Drafter kind: suffix (default) | eagle | standalone | selfspec | hybrid.")
_DRAFTER_DIR = typer.Option(help="Drafter artifact directory (learned drafters); default: day-0.",
                            exists=True, file_okay=False)
_K = typer.Option(help="Maximum drafted tokens per verify step (0 = plain decoding).")
_DTYPE = typer.Option(help="float32 (default) | bfloat16 | float16.")
_DEVICE = typer.Option(help="Torch device (default cpu).")
_THREADS = typer.Option(help="torch intra-op threads.")
_ENGINE = typer.Option(
    # "\\[": Rich markup would take [sglang] for a style tag and drop it from the help
    help="torch (default) | sglang (CUDA GPU; needs `pip install 'specloop\\[sglang]'`; its other "
    "settings are SPECLOOP_SGLANG_* variables, see README).")


def _default_loader(overrides: dict):
    from serving.config import ServingSettings

    return ServingSettings(**overrides)


_loader = _default_loader


def use_settings(loader) -> None:
    """Where these commands get their settings: ``loader(overrides) -> ServingSettings``. The
    ``specloop`` CLI installs infra's settings tree (infra/root.py) here, so a served replica's
    endpoints are the ones every other process reads."""
    global _loader
    _loader = loader


def _settings(**overrides):
    try:
        settings = _loader({k: v for k, v in overrides.items() if v is not None})
    except SETTINGS_ERRORS as exc:
        raise typer.BadParameter(first_settings_error(exc)) from exc
    if settings.engine == "torch" and settings.drafter == "suffix" and settings.drafter_dir is not None:
        raise typer.BadParameter(  # the suffix drafter has no artifact: the directory would be ignored
            f"drafter_dir={settings.drafter_dir} holds a learned drafter, but drafter=suffix has none: "
            "use --drafter hybrid (the suffix index + that drafter), eagle, standalone or selfspec")
    return settings


def _build_engine(settings):
    """The engine, or one line on what is wrong with the model or drafter it was given."""
    from feedback.registry.artifact import DrafterArtifactError
    from serving.builder import build_engine

    try:
        return build_engine(settings)
    except (DrafterArtifactError, OSError, ValueError) as exc:  # a missing model, a refused artifact
        log.debug("engine not built", exc_info=True)
        typer.echo(f"Error: {exc}", err=True)
        raise typer.Exit(1) from None


_LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def _log_level(value: str) -> str:
    if value.lower() not in _LOG_LEVELS:
        raise typer.BadParameter(f"{value!r}: one of {' | '.join(_LOG_LEVELS)}")
    return value.lower()


def _require_engine(engine: str | None) -> None:
    """Before anything else: an engine that cannot run here is the first thing to fix (checked
    before the settings that depend on it, and before any model is loaded)."""
    from pydantic import ValidationError

    from serving.builder import EngineUnavailable, require_engine
    from serving.config import EngineChoice

    try:
        name = EngineChoice(**({"engine": engine} if engine is not None else {})).engine
    except ValidationError as exc:
        raise typer.BadParameter(first_error(exc)) from exc
    try:
        require_engine(name)
    except EngineUnavailable as exc:
        typer.echo(f"Error: {exc}", err=True)
        raise typer.Exit(1) from None


def serve(
    engine: Annotated[str | None, _ENGINE] = None,
    model: Annotated[str | None, _MODEL] = None,
    served_model_name: Annotated[
        str | None, typer.Option(help="Name clients pass as `model`.")
    ] = None,
    drafter: Annotated[str | None, _DRAFTER] = None,
    drafter_dir: Annotated[Path | None, _DRAFTER_DIR] = None,
    k: Annotated[int | None, _K] = None,
    max_batch_size: Annotated[int | None, typer.Option(help="Requests decoded together.")] = None,
    host: Annotated[str | None, typer.Option(help="Bind address (default 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option(help="Port (default 8000).")] = None,
    trace_sink: Annotated[str | None, typer.Option(help="none (default) | memory | kafka.")] = None,
    dtype: Annotated[str | None, _DTYPE] = None,
    device: Annotated[str | None, _DEVICE] = None,
    num_threads: Annotated[int | None, _THREADS] = None,
    log_level: Annotated[str, typer.Option(help=f"Log level: {' | '.join(_LOG_LEVELS)}.",
                                           callback=_log_level)] = "info",
) -> None:
    """Serve the OpenAI-compatible API with speculative decoding.

    The admin token is read from SPECLOOP_ADMIN_TOKEN only (not a flag: argv is visible to all).
    SPECLOOP_ENGINE=sglang (or --engine sglang) serves through SGLang on a CUDA GPU."""
    _require_engine(engine)  # fail fast: before imports, settings checks and model loading
    import uvicorn

    from serving.api.app import create_app

    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    settings = _settings(
        engine=engine,
        model=model,
        served_model_name=served_model_name,
        drafter=drafter,
        drafter_dir=drafter_dir,
        k=k,
        max_batch_size=max_batch_size,
        host=host,
        port=port,
        trace_sink=trace_sink,
        dtype=dtype,
        device=device,
        num_threads=num_threads,
    )
    # One engine per process: its metrics go to the global registry, next to the process metrics.
    app = create_app(_build_engine(settings), settings)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=log_level.lower())


def generate(
    prompt: Annotated[str, typer.Argument(help="The prompt (a user message unless --raw).")],
    raw: Annotated[
        bool, typer.Option("--raw", help="Send the prompt as is, without the chat template.")
    ] = False,
    max_tokens: Annotated[int, typer.Option(help="Most tokens to generate.")] = 128,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass.")] = 1.0,
    top_k: Annotated[int, typer.Option(help="Top-k cut (0 = none).")] = 0,
    seed: Annotated[int | None, typer.Option(help="Sampling seed.")] = None,
    model: Annotated[str | None, _MODEL] = None,
    drafter: Annotated[str | None, _DRAFTER] = None,
    drafter_dir: Annotated[Path | None, _DRAFTER_DIR] = None,
    k: Annotated[int | None, _K] = None,
    dtype: Annotated[str | None, _DTYPE] = None,
    device: Annotated[str | None, _DEVICE] = None,
    num_threads: Annotated[int | None, _THREADS] = None,
    engine: Annotated[str | None, _ENGINE] = None,
) -> None:
    """Run one prompt from the shell: the text streams to stdout, speculative stats to stderr."""
    import asyncio

    _require_engine(engine)
    settings = _settings(
        engine=engine,
        model=model,
        drafter=drafter,
        drafter_dir=drafter_dir,
        k=k,
        dtype=dtype,
        device=device,
        num_threads=num_threads,
        trace_sink="none",
    )
    stats = asyncio.run(
        _generate_once(
            settings,
            prompt,
            raw,
            {
                "max_tokens": max_tokens,
                "temperature": temperature,
                "top_p": top_p,
                "top_k": top_k,
                "seed": seed,
            },
        )
    )
    from rich.console import Console

    Console(stderr=True).print(
        f"\n[dim]{stats['completion_tokens']} tokens in {stats['seconds']:.2f} s "
        f"({stats['completion_tokens'] / max(stats['seconds'], 1e-9):.1f} tok/s) · "
        f"{stats['verify_steps']} verify steps · {stats['mean_accept_len']:.2f} tokens/step · "
        f"acceptance {stats['acceptance_rate']:.2f} ({stats['accepted_tokens']}/{stats['drafted_tokens']}) · "
        f"drafter {settings.drafter} · finish {stats['finish_reason']}[/dim]"
    )


async def _generate_once(settings, prompt: str, raw: bool, params: dict) -> dict:
    """Runs through the same request checks as the HTTP API."""
    import sys
    import time
    import uuid

    from pydantic import ValidationError

    from serving.api import protocol as p
    from serving.api.errors import APIError
    from serving.api.openai_serving import OpenAIServing

    try:  # parameter checks first: loading the model takes a while
        if raw:
            req = p.CompletionRequest(prompt=prompt, **params)
        else:
            req = p.ChatCompletionRequest(messages=[{"role": "user", "content": prompt}], **params)
    except ValidationError as exc:
        raise typer.BadParameter(first_error(exc)) from exc
    engine = _build_engine(settings)
    serving = OpenAIServing(engine, settings)
    try:
        if raw:
            ids, param = serving.encode_prompt(req.prompt), "prompt"
        else:
            ids, param = serving.encode_chat(req.messages), "messages"
        greq = serving.engine_request(req, ids, param, f"cli-{uuid.uuid4().hex[:8]}")
    except APIError as exc:
        raise typer.BadParameter(exc.message) from exc
    await engine.start()
    try:
        t0, last = time.perf_counter(), None
        async for chunk in serving.generate(greq):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            last = chunk
        seconds = time.perf_counter() - t0
    finally:
        await engine.stop()
    sys.stdout.write("\n")
    s = last.stats
    return {
        "completion_tokens": last.completion_tokens,
        "seconds": seconds,
        "finish_reason": last.finish_reason,
        "verify_steps": s.verify_steps,
        "drafted_tokens": s.drafted_tokens,
        "accepted_tokens": s.accepted_tokens,
        "mean_accept_len": s.mean_accept_len,
        "acceptance_rate": s.acceptance_rate,
    }
