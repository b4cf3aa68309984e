"""``specloop bench online``: the closed loop on a domain-shift stream, against target-only decoding
and a drafter frozen at the shift, for the hybrid, suffix-only and learned-only drafters.

Per drafter kind: serve the stream through the loop (trainer + swaps for learned kinds; the suffix
index learns on its own), snapshot the drafter at the shift, then serve the post-shift prompts again
with the snapshot frozen. The target-only run (same prompts, k = 0) is shared; it is the speed
baseline and the greedy reference for ``lossless``. The top-level figures are the hybrid's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import tempfile
import uuid

import typer

from benchmarks.online_loop import LoopConfig, OnlineLoop
from benchmarks.online_metrics import shift_index, summarise

log = logging.getLogger(__name__)
KINDS = ("hybrid", "suffix", "standalone")


def stream_items(prompts_file: str | None, n_chat: int, n_code: int) -> list:
    """PromptItems in serving order: the file's order, or MT-Bench chat then HumanEval code."""
    from benchmarks.prompts import interleave_categories, load_humaneval, load_jsonl, load_mtbench

    if prompts_file:
        return load_jsonl(prompts_file)
    return interleave_categories(load_mtbench())[:n_chat] + load_humaneval()[:n_code]


def encode(items, tokenizer) -> list[tuple[list[int], str]]:
    return [(item.token_ids(tokenizer), item.domain or "default") for item in items]


async def target_only(target, stream, max_tokens: int):
    loop = OnlineLoop(target, None, LoopConfig(k=0, train=False, max_tokens=max_tokens))
    await loop.start()
    try:
        await loop.serve([(stream[0][0][:8], stream[0][1])])  # warm-up (first forwards are slow)
        loop.points.clear()
        return await loop.serve(stream)
    finally:
        await loop.stop()


async def adapted_and_frozen(target, stack, stream, cfg: LoopConfig, on_point=None):
    """The loop over the stream (snapshot at the shift), then the frozen snapshot after the shift."""
    shift = shift_index([d for _, d in stream])
    loop = OnlineLoop(target, stack, cfg, tag=uuid.uuid4().hex[:8])
    await loop.start()
    try:
        await loop.serve(stream[:shift], on_point)
        loop.snapshot()
        await loop.serve(stream[shift:], on_point)
    finally:
        await loop.stop()
    frozen_cfg = LoopConfig(**{**cfg.__dict__, "train": False})
    frozen = OnlineLoop(target, None, frozen_cfg, tag=loop.tag, drafter=loop.frozen_drafter())
    await frozen.start()
    try:
        frozen_points = await frozen.serve(stream[shift:], train=False)
    finally:
        await frozen.stop()
    return loop, frozen_points


def trainer_figures(loop: OnlineLoop) -> dict:
    """What the loop's trainer did (nothing for the suffix drafter, which has none)."""
    if loop.trainer is None:
        return {}
    st = loop.trainer.stats
    return {"trainer_records_polled": st.records_polled, "trainer_rounds": st.rounds,
            "trainer_train_steps": st.train_steps, "trainer_promotions": st.promotions,
            "trainer_heldout_expected_acceptance": st.heldout_acceptance, "trainer_last_gate": st.last_decision,
            "gate_costs": {k: round(v, 4) for k, v in loop.costs.items()}}


async def run_all(target, stack, stream, cfg: LoopConfig, kinds=KINDS) -> dict:
    shift = shift_index([d for _, d in stream])
    baseline = await target_only(target, stream, cfg.max_tokens)
    by_drafter = {}
    for kind in kinds:
        log.info("bench online: %s drafter", kind)
        loop, frozen = await adapted_and_frozen(target, stack, stream, LoopConfig(**{**cfg.__dict__, "drafter": kind}))
        by_drafter[kind] = summarise(loop.points, shift, baseline=baseline, frozen=frozen, swaps=loop.swaps,
                                     rollbacks=loop.rollbacks, freshness=loop.freshness_s())
        by_drafter[kind].update(trainer_figures(loop))
    head = dict(by_drafter.get("hybrid") or next(iter(by_drafter.values())))
    head["target_only_tok_s"] = sum(p.tokens for p in baseline) / max(1e-9, sum(p.wall_s for p in baseline))
    return {**head, "by_drafter": by_drafter}


def bench_online(
    json_out: bool = typer.Option(True, "--json/--no-json", help="One JSON object on stdout."),
    prompts: str = typer.Option(None, help="JSONL stream (prompt or messages, domain); served in file order."),
    max_tokens: int = typer.Option(48, min=1, help="New tokens per request."),
    chat: int = typer.Option(24, min=1, help="MT-Bench chat requests before the shift (no --prompts)."),
    code: int = typer.Option(24, min=1, help="HumanEval code requests after the shift (no --prompts)."),
    k: int = typer.Option(4, min=1, help="Most drafted tokens per step."),
    adaptive_k: bool = typer.Option(False, help="GoodputPolicy instead of fixed k."),
    drafter: list[str] = typer.Option(list(KINDS), help="Drafter kinds to run (repeatable)."),
    threads: int = typer.Option(1, min=1, help="torch threads per thread of work: serving and the trainer each run on this many cores (1 on a 2-core box: the CPU stand-in for the serving GPU and the trainer GPU); the target-only baseline runs with the same."),
    verbose: bool = typer.Option(True, help="Progress logs on stderr."),
) -> None:
    """Online adaptation on a domain-shift stream: speedups, recovery, swaps, freshness."""
    logging.basicConfig(stream=sys.stderr, level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import torch

    from infra.stack import Stack
    from serving.target import load_target

    torch.set_num_threads(threads)
    target = load_target()
    stream = encode(stream_items(prompts, chat, code), target.tokenizer)
    cfg = LoopConfig(k=k, max_tokens=max_tokens, adaptive_k=adaptive_k)
    with tempfile.TemporaryDirectory(prefix="specloop-bench-online-") as tmp:
        stack = Stack(tmp)
        try:
            info = stack.up()
            out = asyncio.run(run_all(target, info, stream, cfg, tuple(drafter)))
        finally:
            stack.down()
    print(json.dumps(out, indent=None if json_out else 2, default=float))
