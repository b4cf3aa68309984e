"""``specloop bench ...`` commands that live in benchmarks/ (each prints one JSON object, benchmarks/output.py)."""

from __future__ import annotations

import logging
import sys
from typing import Literal

import typer

from benchmarks.engine_options import bf16_activations_option
from benchmarks.output import json_option, print_json
from infra.prompts import prompt_domains, prompts_callback
from infra.suffix_seed import seed_option


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(stream=sys.stderr, level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def spec(
    json_out: bool = json_option(),
    prompts: str = typer.Option(None, callback=prompts_callback,
                                help="JSONL prompt file (lines with prompt or messages, optional domain), or \"sharegpt\" (held-out real user prompts)."),
    limit: int = typer.Option(8, min=1, help="Evaluation prompts per domain."),
    max_tokens: int = typer.Option(96, min=1, help="New tokens per prompt."),
    k: int = typer.Option(8, min=1, help="Most drafted tokens (tree nodes) per step; serving's default."),
    drafter: Literal["suffix", "eagle", "standalone", "selfspec", "hybrid"] = typer.Option(
        "suffix", help="suffix | eagle | standalone | selfspec | hybrid"),
    warm: int = typer.Option(16, min=0, help="Other prompts of the same domain served before measuring (0 = day 0 only)."),
    artifact: str = typer.Option(None, help="Drafter artifact directory for learned drafters (default: day-0 init)."),
    threads: int = typer.Option(2, min=1, help="torch threads."),
    dtype: Literal["float32", "bfloat16"] = typer.Option("float32", help="float32 (exactly lossless on CPU) | bfloat16"),
    domain: list[str] = typer.Option(None, help="Only these domains (repeatable): chat, code for the built-in "
                                     "prompt sets, a JSONL file's own domains."),
    policy: Literal["adaptive", "fixed", "both"] = typer.Option("adaptive", help="adaptive (GoodputPolicy picks 0..k, serving's default) | fixed (k every step) | "
                               "both (same prompts, adds adaptive_vs_fixed)."),
    tree: bool = typer.Option(True, "--tree/--no-tree", help="Suffix drafter proposes token trees of "
                              "up to k nodes (the adaptive policy cuts them to what pays)."),
    batch: str = typer.Option("", help="Comma-separated batch sizes (e.g. 1,4,8) for the never-slower "
                              "check: target-only vs adaptive speculation at each, A/B in one process."),
    batch_repeats: int = typer.Option(4, min=1, help="A/B rounds per batch size (ABBA order)."),
    device: str = typer.Option("cpu", help="torch device for the target (e.g. cuda:0)."),
    cuda_graphs: bool = typer.Option(True, "--cuda-graphs/--no-cuda-graphs", help="On CUDA, steps "
                                     "replay CUDA graphs (EngineConfig.cuda_graphs); off: launched op by op."),
    verbose: bool = typer.Option(True, help="Progress logs on stderr."),
    suffix_seed: int = seed_option(),
    bf16_activations: bool = bf16_activations_option(),
    temperature: float = typer.Option(0.0, min=0.0, max=2.0, help="Every request's temperature: 0 greedy; "
                                      "above, sampled (what an OpenAI client gets by default at 1.0), "
                                      "seeded per prompt so that lossless is still token identity."),
) -> None:
    """Speedup of speculative decoding over target-only decoding, day 0 and warmed."""
    batches = _batch_sizes(batch)
    _check_domains(domain, prompts)
    _setup_logging(verbose)
    from benchmarks.bench_spec import run

    out = run(prompts, limit, max_tokens, k, drafter, warm, artifact, threads, dtype, domain, policy,
              tree, batches, batch_repeats, device, cuda_graphs, suffix_seed, bf16_activations, temperature)
    print_json(out, json_out)


def _batch_sizes(text: str) -> tuple[int, ...]:
    """``--batch 1,4,8`` as (1, 4, 8); a usage error (before any model loads) for anything else."""
    try:
        sizes = tuple(int(b) for b in text.split(",") if b.strip())
    except ValueError:
        sizes = (0,)
    if any(b < 1 for b in sizes):
        raise typer.BadParameter(f"{text!r}: comma-separated batch sizes >= 1, e.g. 1,4,8",
                                 param_hint="--batch")
    return sizes


def _check_domains(domains: list[str] | None, prompts: str | None) -> None:
    """``--domain`` values the prompt set has; a usage error (before any model loads) otherwise."""
    if not domains:  # nothing to check: the file is not read again
        return
    have = prompt_domains(prompts)
    unknown = [d for d in domains if d not in have]
    if unknown:
        raise typer.BadParameter(f"{', '.join(map(repr, unknown))}: the prompt set's domains are "
                                 f"{', '.join(have)}", param_hint="--domain")


def capture(
    json_out: bool = json_option(),
    tiny: bool = typer.Option(False, "--tiny", help="A tiny random model instead of SmolLM2 (smoke runs)."),
    prompts: str = typer.Option(None, callback=prompts_callback,
                                help="JSONL prompt file or \"sharegpt\" (default: MT-Bench + HumanEval)."),
    limit: int = typer.Option(8, min=1, help="Prompts per run (round-robin over domains)."),
    max_tokens: int = typer.Option(64, min=1, help="New tokens per prompt."),
    k: int = typer.Option(4, min=1, help="Drafted tokens per step (suffix drafter)."),
    concurrency: int = typer.Option(4, min=1, help="Requests in flight (and engine batch size)."),
    repeats: int = typer.Option(3, min=1, help="Pairs of runs (capture, no capture), order alternating."),
    features: bool = typer.Option(False, "--features", help="Capture also records target hidden states."),
    threads: int = typer.Option(2, min=1, help="torch threads."),
    dtype: Literal["float32", "bfloat16"] = typer.Option("float32", help="float32 (exactly lossless on CPU) | bfloat16"),
    verbose: bool = typer.Option(True, help="Progress logs on stderr."),
    bf16_activations: bool = bf16_activations_option(),
) -> None:
    """Serving throughput with trace export to a (self-started) broker vs without capture."""
    _setup_logging(verbose)
    logging.getLogger("kafka").setLevel(logging.WARNING)  # connection chatter at INFO
    from benchmarks.bench_capture import run

    out = run(prompts, tiny, limit, max_tokens, k, concurrency, repeats, features, threads, dtype,
              bf16_activations)
    print_json(out, json_out)
