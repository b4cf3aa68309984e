"""``specloop bench interference``: how much a drafter in training slows serving beside it.

The demo and compose run serving and the trainer side by side, each on its own cores (on this
2-core machine one each); issue 13 allows the trainer to slow serving by at most 5 %. They share
the memory bus and the last-level cache, which no core split separates. This bench measures
that pair:

- serving: a target-only TorchEngine (``--threads`` torch threads, pinned to the first cores)
  decoding the same prompts in every round (greedy, ``--max-tokens`` each, one at a time);
- trainer: a separate process, pinned to the other cores and niced as the loop's trainer
  (``LoopConfig.trainer_nice``), that builds the trainer's day-0 student
  (``trainer.cli.make_student``, ``--drafter`` kind) and runs ``Distiller.step`` on batches of
  real traces back to back (traces of the target on the bench's prompts, recorded first, as the
  serving loop records them).

Rounds alternate the trainer stopped (SIGSTOP: no CPU, no memory traffic) and training (SIGCONT),
in ABBA order, so that a slow period of the machine weighs on both. Prints one JSON object:

    serving_tok_s_alone         serving tok/s with the trainer stopped (all rounds)
    serving_tok_s_beside_trainer  serving tok/s while it trains
    serving_slowdown            1 - beside / alone (the issue's bar: <= 0.05)
    round_ratios                beside / alone per ABBA pair
    trainer_steps_per_s         the trainer's distillation steps per second while serving
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import tempfile
import time
from pathlib import Path

import typer

from benchmarks.output import json_option, print_json
from benchmarks.runner import check_precision, prefix_hits


def _pin(cpus: set[int]) -> None:
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)


def _train_forever(model_dir: str, kind: str, traces_path: str, cpus: list[int], threads: int,
                   nice: int, precision: str, steps, ready, stop) -> None:
    """The trainer process: the trainer's student and Distiller, stepping until ``stop`` is set."""
    _pin(set(cpus))
    os.nice(nice)
    import torch

    from feedback.bus.trace_file import load_traces
    from trainer.cli import make_student
    from trainer.distill import DistillConfig, Distiller

    torch.set_num_threads(threads)
    records = load_traces(traces_path)
    cfg = DistillConfig(precision=precision)
    distiller = Distiller(make_student(model_dir, kind, cfg.max_len), cfg)
    batches = [records[i : i + cfg.batch_traces] for i in range(0, len(records), cfg.batch_traces)]
    distiller.step(batches[0])  # warm: first steps allocate
    ready.set()
    n = 0
    while not stop.is_set():
        distiller.step(batches[n % len(batches)])
        n += 1
        with steps.get_lock():
            steps.value += 1


def serving_config():
    """The serving engine's config. No prefix cache: every round serves the same prompts again,
    and with one only the first arm (alone) prefilled them while the others copied them in."""
    from serving.engine.config import EngineConfig

    return EngineConfig(k=0, max_batch_size=1, prefix_cache_tokens=0)


async def _serve_round(engine, prompts: list[list[int]], max_tokens: int, tag: str) -> tuple[int, float]:
    from serving.engine.base import GenerationRequest, SamplingParams

    tokens, t0 = 0, time.perf_counter()
    for i, ids in enumerate(prompts):
        req = GenerationRequest(request_id=f"{tag}-{i}", prompt_ids=ids,
                                params=SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        async for chunk in engine.generate(req):
            tokens += len(chunk.token_ids)
    return tokens, time.perf_counter() - t0


def run(prompts_spec: str | None, limit: int, max_tokens: int, rounds: int, drafter: str,
        threads: int, precision: str = "auto") -> dict:
    import torch

    from benchmarks.bench_train import generate_traces
    from feedback.bus.trace_file import save_traces
    from feedback.target.location import resolve_model_path
    from infra.loop import LoopConfig
    from infra.prompts import load_prompts
    from serving.engine.torch_engine import TorchEngine
    from serving.target import load_target
    from trainer.distill import autocast_bf16

    bf16 = autocast_bf16(precision, torch.device("cpu"))  # a bad value is refused before anything starts
    ncpu = os.cpu_count() or 2
    serve_cpus = set(range(min(threads, ncpu - 1)))
    train_cpus = sorted(set(range(ncpu)) - serve_cpus)
    _pin(serve_cpus)
    torch.set_num_threads(len(serve_cpus))
    target = load_target()
    items = load_prompts(prompts_spec, n_chat=limit, n_code=limit)
    prompts = [it.token_ids(target.tokenizer) for it in items][: 2 * limit]
    model_dir, _ = resolve_model_path(None)

    with tempfile.TemporaryDirectory(prefix="specloop-bench-interference-") as tmp:
        traces_path = Path(tmp) / "traces.bin"
        save_traces(generate_traces(target, prompts, max_new_tokens=max_tokens), traces_path)
        ctx = mp.get_context("spawn")
        steps, ready, stop = ctx.Value("l", 0), ctx.Event(), ctx.Event()
        trainer = ctx.Process(target=_train_forever, daemon=True, args=(
            str(model_dir), drafter, str(traces_path), train_cpus, len(train_cpus),
            LoopConfig().trainer_nice, precision, steps, ready, stop))
        trainer.start()
        try:
            if not ready.wait(300):
                raise RuntimeError("the trainer process did not start training within 300 s")
            result = asyncio.run(_rounds(target, prompts, max_tokens, rounds, trainer.pid, steps,
                                         serving_config(), TorchEngine))
        finally:
            stop.set()  # let it finish its step and exit (a killed child leaks its semaphores)
            os.kill(trainer.pid, signal.SIGCONT)
            trainer.join(60)
            if trainer.is_alive():
                trainer.terminate()
                trainer.join(10)
    result.update({"model": target.model_id, "prompts": len(prompts), "max_tokens": max_tokens,
                   "drafter": drafter, "precision": "bf16" if bf16 else "fp32",
                   "serving_cpus": sorted(serve_cpus), "trainer_cpus": train_cpus})
    return result


async def _rounds(target, prompts, max_tokens, rounds, pid, steps, config, engine_cls) -> dict:
    engine = engine_cls(target, None, config=config)
    await engine.start()
    alone, beside, ratios, train_s, train_steps = [0, 0.0], [0, 0.0], [], 0.0, 0
    cached = {"alone": 0, "beside": 0}  # prompt tokens a prefix cache served, per arm
    try:
        os.kill(pid, signal.SIGSTOP)
        await _serve_round(engine, prompts[:1], 8, "warm")
        for r in range(rounds):
            order = ("alone", "beside") if r % 2 == 0 else ("beside", "alone")
            rates = {}
            for phase in order:
                if phase == "beside":
                    os.kill(pid, signal.SIGCONT)
                    s0 = steps.value
                hits = prefix_hits(engine)
                tokens, secs = await _serve_round(engine, prompts, max_tokens, f"r{r}-{phase}")
                cached[phase] += prefix_hits(engine) - hits
                if phase == "beside":
                    os.kill(pid, signal.SIGSTOP)
                    train_steps += steps.value - s0
                    train_s += secs
                acc = alone if phase == "alone" else beside
                acc[0] += tokens
                acc[1] += secs
                rates[phase] = tokens / secs
            ratios.append(round(rates["beside"] / rates["alone"], 4))
    finally:
        os.kill(pid, signal.SIGCONT)
        await engine.stop()
    tok_alone, tok_beside = alone[0] / alone[1], beside[0] / beside[1]
    return {
        "serving_tok_s_alone": round(tok_alone, 2),
        "serving_tok_s_beside_trainer": round(tok_beside, 2),
        "serving_slowdown": round(1.0 - tok_beside / tok_alone, 4),
        "round_ratios": ratios,
        "cached_prompt_tokens": cached,
        "trainer_steps_per_s": round(train_steps / train_s, 3) if train_s else 0.0,
        "rounds": rounds,
    }


def bench_interference(
    json_out: bool = json_option(),
    prompts: str = typer.Option(None, help="Prompt set: None (MT-Bench + HumanEval), \"sharegpt\" or a JSONL file."),
    limit: int = typer.Option(4, min=1, help="Prompts per domain served in each round."),
    max_tokens: int = typer.Option(48, min=1, help="New tokens per prompt."),
    rounds: int = typer.Option(4, min=2, help="A/B rounds (ABBA order)."),
    drafter: str = typer.Option("standalone", help="The trainer's student: standalone | selfspec (the traces carry no target features, which eagle needs)."),
    threads: int = typer.Option(1, min=1, help="Serving's torch threads (its cores); the trainer gets the rest."),
    precision: str = typer.Option("auto", callback=check_precision,
                                  help="The trainer's precision: auto (bf16 autocast where native), bf16 or fp32."),
) -> None:
    """Serving tok/s with a training drafter beside it vs without; print serving_slowdown."""
    result = run(prompts, limit, max_tokens, rounds, drafter, threads, precision)
    print_json(result, json_out)
