"""``specloop bench online``: the closed loop on a domain-shift stream, against target-only decoding
and a static drafter after the shift, for the hybrid, suffix-only and learned-only drafters.

Per drafter kind: serve the stream through the loop (trainer + swaps for learned kinds; the suffix
index learns on its own). Every request is also served target-only (k = 0), and every post-shift
request also with the static drafter (the same kind trained offline on the target's pre-shift
responses, or the loop's own drafter frozen at the shift), each right before or after the loop's
(infra/paired_serving.py): the target-only requests are the kind's speed baseline and the greedy
reference for ``lossless``, the static ones ``static_vs_adapted_after_shift``'s. One shared
target-only run, minutes before the last kind, let this VM's drift (the baseline moved by 11 %
within one 13-minute run) read as speculation's gain or loss: the suffix drafter's day 0 read 1.050
in one run and 0.919 in the next with no change to it; the static replay after the stream did the
same to ``static_vs_adapted_after_shift`` until the twenty-third session. The pairing also puts a
learned kind's trainer beside all three (``bench interference`` measures what it costs serving).
The top-level figures are the hybrid's.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import sys
import tempfile
import time
import uuid
from typing import Literal

import typer

from benchmarks.output import json_option, print_json
from benchmarks.static_fits import StaticFits, static_drafter
from infra.artifact_options import DAY0_OPTION, check_target, day0_artifact_meta
from infra.loop import LoopConfig, OnlineLoop
from infra.loop_metrics import (
    paired_speedup_interval,
    served_bf16_activations,
    shift_index,
    summarise,
)
from infra.loop_metrics import trainer_figures as loop_trainer_figures
from infra.paired_serving import serve_paired, target_only_loop, warmed
from infra.prompts import encode, prompts_callback, stream_items
from infra.suffix_seed import (
    load_model_option,
    model_option,
    seed_option,
    seed_summary,
    use_suffix_seed,
)

log = logging.getLogger(__name__)
KINDS = ("hybrid", "suffix", "standalone")
STATIC_BASELINES = ("offline", "snapshot")


HELDOUT_EVERY = 5
"""Every 5th request is served with ``train: false``: never trained on, it is the held-out set the
final learned drafter's acceptance is measured on (``heldout_acceptance_after_shift``)."""


def trainer_figures(loop: OnlineLoop) -> dict:
    """The loop's trainer figures, plus the final learned drafter's held-out acceptance."""
    if loop.trainer is None:
        return {}
    extra = {"heldout_acceptance_after_shift": heldout_acceptance(loop)}
    if getattr(loop, "static_fit", None):
        extra["static_fit"] = loop.static_fit
    return loop_trainer_figures(loop, **extra)


def is_heldout(i: int) -> bool:
    return i % HELDOUT_EVERY == HELDOUT_EVERY - 1


def trained(position: int) -> bool:
    return not is_heldout(position)


async def adapted_and_frozen(target, stack, stream, cfg: LoopConfig, on_point=None, static: str = "offline",
                             paired: OnlineLoop | None = None, fits: StaticFits | None = None, at_shift=None):
    """The loop over the stream (snapshot at the shift) and, from the shift on, the static drafter
    beside it, request by request: ``offline``: the same kind trained offline on the target's
    pre-shift responses (``static_drafter``, trained once per ``fits``; a fit nobody started in
    the background is trained here at the shift, pausing the stream while the loop's trainer goes
    on: ``static_fit.paused_stream_s``); ``snapshot``: the loop's own drafter frozen at the shift.
    ``paired``: a target-only loop that serves every request beside the loop's. Paired serving
    (infra/paired_serving.py) keeps the machine's drift out of both comparisons.
    ``at_shift(loop)``: called once the pre-shift requests are served. Returns the loop and the
    static drafter's points on the post-shift requests."""
    if static not in STATIC_BASELINES:  # else a misspelt "offline" ran the snapshot
        raise ValueError(f"static must be one of {', '.join(STATIC_BASELINES)}, got {static!r}")
    shift = shift_index([d for _, d in stream])
    loop = OnlineLoop(target, stack, cfg, tag=uuid.uuid4().hex[:8])
    beside = [paired] if paired is not None else []
    frozen = None
    await loop.start()
    try:
        await serve_paired(loop, stream[:shift], 0, on_point, beside, train=trained)
        loop.snapshot()
        if at_shift is not None:
            at_shift(loop)
        t0 = time.perf_counter()
        if static == "offline" and cfg.drafter != "suffix":
            fixed, fit = static_drafter(target, loop, cfg, fits=fits)
            loop.static_fit = {**fit, "paused_stream_s": round(time.perf_counter() - t0, 1)}
        else:
            fixed = loop.frozen_drafter()
        frozen_cfg = LoopConfig(**{**cfg.__dict__, "train": False})
        frozen = await warmed(OnlineLoop(target, None, frozen_cfg, tag=loop.tag, drafter=fixed), stream)
        await serve_paired(loop, stream[shift:], shift, on_point, [*beside, frozen], train=trained)
    finally:
        if frozen is not None:
            await frozen.stop()
        await loop.stop()
    return loop, frozen.points


def learned_model(drafter):
    """The live learned model (hybrid: its learned half) and its draft vocabulary, or (None, None)."""
    learned = getattr(drafter, "learned", drafter)
    model = getattr(learned, "model", None)
    net = getattr(learned, "net", None)
    return model, getattr(net, "vocab_map", None)


def heldout_acceptance(loop: OnlineLoop, drafter=None) -> dict:
    """Greedy one-token acceptance of the live learned drafter on the held-out requests (served
    with train: false), by domain: its argmax at each output position vs the target's token."""
    import torch

    model, vocab = learned_model(drafter or loop.engine.drafter)
    if model is None or not hasattr(model, "model"):
        return {}
    hits: dict[str, list[int]] = {}
    with torch.inference_mode():
        for i, ((prompt, output), point) in enumerate(zip(loop.served, [p for p in loop.points if not p.failed])):
            if not is_heldout(point.index) or not output:
                continue
            ids = torch.tensor([list(prompt) + list(output)])
            h = model.model(input_ids=ids).last_hidden_state[0, len(prompt) - 1 : -1]  # [T, H]
            w = model.lm_head.weight if vocab is None else model.lm_head.weight[vocab]
            pred = torch.nn.functional.linear(h, w).argmax(-1)  # [T]
            pred = pred if vocab is None else vocab[pred]
            hit = hits.setdefault(point.domain, [0, 0])
            hit[0] += int((pred == torch.tensor(output)).sum())
            hit[1] += len(output)
    return {d: h / n for d, (h, n) in hits.items() if n}


def kind_order(kinds) -> list[str]:
    """The suffix kind first: it has no trainer, so the learned kinds' static baseline trains on the
    free core while it is served (``StaticFits.start``) instead of inline after their streams."""
    return sorted(kinds, key=lambda kind: kind != "suffix")


async def run_all(target, stack, stream, cfg: LoopConfig, static_dir: str, kinds=KINDS,
                  static: str = "offline", load_target=None) -> dict:
    """Every kind's loop, paired target-only run and static baseline; the offline static students
    are saved under ``static_dir``, trained once per recipe (``StaticFits``): in a process of their
    own during the suffix kind's stream when ``load_target`` (picklable: the target, loaded there)
    is given, else inline. The gate's costs are measured once, by the first learned kind's loop."""
    from infra.loop_metrics import tok_s

    shift = shift_index([d for _, d in stream])
    by_drafter = {}
    fits = StaticFits(static_dir)
    kinds = kind_order(kinds)
    learned = [kind for kind in kinds if kind != "suffix"]

    def fit_in_background(loop: OnlineLoop) -> None:
        for kind in learned:  # the suffix loop's pre-shift outputs are the target's own (lossless)
            fits.start(LoopConfig(**{**cfg.__dict__, "drafter": kind}), loop.served[: loop.snapshot_at], 200,
                       load_target, target.fingerprint, cfg.trainer_nice)

    try:
        for kind in kinds:
            log.info("bench online: the %s drafter, each request also target-only (after the shift: and static)", kind)
            started = time.perf_counter()
            background = kind == "suffix" and learned and load_target is not None and static == "offline"
            at_shift = fit_in_background if background else None
            base = await target_only_loop(target, stream, cfg.max_tokens)
            try:
                loop, frozen = await adapted_and_frozen(target, stack, stream,
                                                        LoopConfig(**{**cfg.__dict__, "drafter": kind}),
                                                        static=static, paired=base, fits=fits, at_shift=at_shift)
            finally:
                await base.stop()
            if loop.costs and cfg.gate_costs is None:
                cfg = LoopConfig(**{**cfg.__dict__, "gate_costs": loop.costs})  # the same target and student
            baseline = base.points
            by_drafter[kind] = summarise(loop.points, shift, baseline=baseline, frozen=frozen, swaps=loop.swaps,
                                         rollbacks=loop.rollbacks, freshness=loop.freshness(), drifts=loop.drifts)
            base_after = tok_s(baseline[shift:])
            by_drafter[kind]["speedup_after_shift"] = tok_s(loop.points[shift:]) / base_after if base_after else None
            by_drafter[kind]["speedup_after_shift_ci95"] = paired_speedup_interval(loop.points[shift:], baseline[shift:])
            by_drafter[kind]["static_baseline"] = static if kind != "suffix" else "snapshot"
            by_drafter[kind]["target_only_tok_s"] = tok_s(baseline)
            by_drafter[kind].update(trainer_figures(loop))
            # the kind's whole share of the run: its stream with the paired target-only and static
            # requests, and the offline static baseline's training unless it trained in the background
            by_drafter[kind]["wall_s"] = round(time.perf_counter() - started, 1)
    finally:
        fits.close()
    head = dict(by_drafter.get("hybrid") or next(iter(by_drafter.values())))
    learned = by_drafter.get("standalone")
    head["learned_only_speedup_after_shift"] = learned.get("speedup_after_shift") if learned else None
    return {**head, "by_drafter": by_drafter}


def _check_kinds(kinds: list[str]) -> list[str]:
    """``--drafter``: each one of KINDS, refused before anything loads."""
    unknown = [kind for kind in kinds if kind not in KINDS]
    if unknown:
        raise typer.BadParameter(f"{', '.join(map(repr, unknown))}: choose from {', '.join(KINDS)}")
    return kinds


def bench_online(
    json_out: bool = json_option(),
    prompts: str = typer.Option(None, callback=prompts_callback, help="JSONL stream (prompt or messages, domain), served in file order; or \"sharegpt\" (held-out real user prompts: --chat chat then --code code)."),
    max_tokens: int = typer.Option(48, min=1, help="New tokens per request."),
    chat: int = typer.Option(24, min=1, help="Chat requests before the shift (MT-Bench, or ShareGPT with --prompts sharegpt)."),
    code: int = typer.Option(24, min=1, help="Code requests after the shift (HumanEval, or ShareGPT with --prompts sharegpt)."),
    k: int = typer.Option(4, min=1, help="Most drafted tokens per step."),
    adaptive_k: bool = typer.Option(False, help="GoodputPolicy instead of fixed k."),
    drafter: list[str] = typer.Option(list(KINDS), callback=_check_kinds,
                                      help="Drafter kinds to run (repeatable): hybrid | suffix | standalone."),
    threads: int = typer.Option(1, min=1, help="torch threads per thread of work: serving and the trainer each run on this many cores (1 on a 2-core box: the CPU stand-in for the serving GPU and the trainer GPU); the target-only baseline runs with the same."),
    verbose: bool = typer.Option(True, help="Progress logs on stderr."),
    learned: Literal["target-layers", "selfspec"] = typer.Option("target-layers", help="Learned drafter: target-layers (standalone LM copying the "
                                "target's first layers) | selfspec (target's own first layers + trained adapter)."),
    day0_artifact: str = typer.Option(None, help="Start the learned drafter (serving's and the trainer's, and "
                                      "the offline static baseline) from this selfspec artifact, e.g. one "
                                      "pre-trained with `specloop train --corpus`."),
    static: Literal["offline", "snapshot"] = typer.Option("offline", help="Static baseline after the shift: offline (same kind trained offline "
                               "on the target's pre-shift responses) | snapshot (the loop's drafter frozen at the shift)."),
    suffix_seed: int = seed_option(),
    model: str | None = model_option(),
) -> None:
    """Online adaptation on a domain-shift stream: speedups, recovery, swaps, freshness."""
    logging.basicConfig(stream=sys.stderr, level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import torch

    from infra.root import build_stack, cli_settings
    from serving.target import load_target

    settings = cli_settings()  # a bad SPECLOOP_* value: one line, before anything loads
    torch.set_num_threads(threads)
    items = stream_items(prompts, chat, code)  # read before the target loads (checked when parsed)
    day0 = day0_artifact_meta(day0_artifact)
    model = model or settings.serving.model  # --model, else SPECLOOP_MODEL, as the demo and serve read it
    target = load_model_option(model)
    if day0 is not None:  # before the suffix seed and the stack (the loop read it only at its start)
        check_target(day0, day0_artifact, DAY0_OPTION, target.fingerprint)
    seed = use_suffix_seed(target, suffix_seed)  # serving's suffix indexes and the trainer's gate
    stream = encode(items, target.tokenizer)
    cfg = LoopConfig(k=k, max_tokens=max_tokens, adaptive_k=adaptive_k, day0_init=learned, day0_artifact=day0_artifact)
    with tempfile.TemporaryDirectory(prefix="specloop-bench-online-") as tmp:
        stack = build_stack(settings, tmp)
        try:
            started = time.perf_counter()
            info = stack.up()
            out = asyncio.run(run_all(target, info, stream, cfg, f"{tmp}/static", tuple(drafter), static,
                                      load_target=functools.partial(load_target, model)))
            out["bench_wall_s"] = round(time.perf_counter() - started, 1)  # with the stack's start
            out["suffix_seed"] = seed_summary(seed)
            out["bf16_activations"] = served_bf16_activations(settings)
        finally:
            stack.down()
    print_json(out, json_out)
