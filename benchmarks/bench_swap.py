"""``specloop bench swap``: hot-swap drafters repeatedly under concurrent load.

A TorchEngine (SmolLM2-135M by default, ``--tiny`` for a tiny random Llama) serves ``--concurrency``
clients that submit greedy requests back to back while the Swapper alternates between two valid
registered drafter versions (standalone drafters of 1 and 2 target layers whose frozen embedding is
the target's, so their artifacts hold the layers only, as the trainer's do; downloaded from a
sqlite MLflow registry and validated on every swap). Prints one JSON object:

    swaps            swaps that took effect in the engine
    failed_requests  requests that raised or finished with an error
    stall_p99_ms     p99 over swaps of the decode time a swap adds: from ``engine.swap_drafter``
                     being called to the end of the first step of the new drafter, the sum over
                     steps of (gap since the previous step - the median gap between ordinary
                     consecutive steps), floored at 0. The step in progress at the call counts with
                     the fraction of it after the call (the bench hands the drafter over just after
                     a step ends, so that step did not overlap the artifact load). Work the engine
                     moves off the step thread (preparing the new drafter's per-request state on
                     another thread) competes for the same cores, so it shows up here; work left
                     lazy shows up in the first step of the new drafter. Gaps exclude the target
                     prefill of requests admitted in between (no swap causes it, and it would
                     otherwise be the p99 of a few swaps).
    install_stall_p99_ms  the first step of the new drafter alone (gap - median gap): the install
    handover_median_ms  how long ``engine.swap_drafter`` took (the swap's latency in the engine)
    fetch_median_ms  from ``Swapper.swap_to`` to the ``swap_drafter`` call: the artifact's download,
                     validation and build beside the decode steps (and the end of the step then
                     running)
    artifact_mb      the size of each registered version's artifact directory
    load_stall_p99_ms  the same sum from the start of ``Swapper.swap_to`` to the swap_drafter call,
                     while the Swapper downloads and validates the artifact: also caused by a swap,
                     reported apart (the artifact load is the Swapper's, not the engine's)
    null_stall_p99_ms  the noise floor of stall_p99_ms: the same sum over windows as long as the
                     median swap's (call to first new step) that hold no swap and no artifact load
                     (the quiet stretch between a swap's first step and the next load), same base
    lossless         every output equals target-only greedy decoding of its prompt (Hugging Face's
                     on fp32 activations; a k = 0 engine's on bf16 activations, the same arithmetic)
"""

from __future__ import annotations

import asyncio
import itertools
import tempfile
import threading
import time
from pathlib import Path

import typer

from benchmarks.engine_options import bf16_activations_option
from benchmarks.output import json_option, print_json
from infra.loop_metrics import rounds_on_this_cpu

_TEXT_PROMPTS = [
    "Write a short poem about the sea.",
    "Explain how a hash map works.",
    "def fibonacci(n):",
    "List three tips for learning a new language.",
    "What is the capital of France? Answer in one sentence.",
    "Summarise the plot of Hamlet.",
    "Give me a recipe for pancakes.",
    "Why is the sky blue?",
]


class _StepClock:
    """StepObserver: wall-clock time and drafter version of every verify step."""

    wants_topk = False

    def __init__(self):
        self.steps: list[tuple[float, str, int]] = []

    def on_step(self, batch) -> None:
        self.steps.append((time.perf_counter(), batch.drafter_version, len(batch.request_ids)))

    def on_request_start(self, *a, **k) -> None: ...

    def on_request_finish(self, *a, **k) -> None: ...


def _gaps_ms(steps: list[tuple[float, str, int]], prefills: list[tuple[float, float]]) -> list[float]:
    """Per step, ms since the previous step (0 for the first) less the admission prefills (target
    forward of a new prompt, ``prefills``: (start, end)) that ended in between: ordinary work that no
    swap causes, and that would otherwise be the p99 of a few swaps."""
    times = [t for t, _, _ in steps]
    out = [0.0]
    for t0, t1 in itertools.pairwise(times):
        admission = sum(e - s for s, e in prefills if t0 < e <= t1)
        out.append((t1 - t0 - admission) * 1000.0)
    return out


def _stall_ms(steps: list[tuple[float, str, int]], gaps: list[float]) -> tuple[list[float], float]:
    """Extra gap of the first step of each new drafter over the median ordinary gap (ms)."""
    import numpy as np

    ordinary = [g for i, g in enumerate(gaps) if i and steps[i][1] == steps[i - 1][1]]
    base = float(np.median(ordinary)) if ordinary else 0.0
    swap = [g for i, g in enumerate(gaps) if i and steps[i][1] != steps[i - 1][1]]
    return [max(0.0, g - base) for g in swap], base


def _window_stalls(
    steps: list[tuple[float, str, int]],
    gaps: list[float],
    base: float,
    starts: list[float],
    ends: list[float] | None,
) -> list[float]:
    """Per swap (in order): the extra time (ms, floored at 0) over ``base`` per step of the steps
    within (``starts[i]``, ``ends[i]``] (None: up to and including the first step of the new
    drafter); a step that straddles a bound counts with the fraction of it inside."""
    times = [t for t, _, _ in steps]
    firsts = [i for i in range(1, len(steps)) if steps[i][1] != steps[i - 1][1]]
    out = []
    for n, (start, first) in enumerate(zip(starts, firsts)):
        end = times[first] if ends is None else ends[n]
        out.append(_excess(times[: first + 1], gaps, base, start, end))
    return out


def _excess(times: list[float], gaps: list[float], base: float, start: float, end: float) -> float:
    """The extra time (ms, floored at 0) over ``base`` per step of the steps within (``start``,
    ``end``]; a step that straddles a bound counts with the fraction of it inside."""
    extra = 0.0
    for i in range(1, len(times)):
        t0, t1 = times[i - 1], times[i]
        inside = min(t1, end) - max(t0, start)
        if inside > 0:
            extra += inside / (t1 - t0) * (gaps[i] - base)
    return max(0.0, extra)


def _null_stalls(
    steps: list[tuple[float, str, int]],
    gaps: list[float],
    base: float,
    swap_called: list[float],
    load_started: list[float],
) -> list[float]:
    """The swap windows' statistic (``_window_stalls``) over windows without a swap: as long as
    the median swap window, laid every half width through each quiet stretch (from two steps
    after a swap's first new step to the next artifact load), floored at 0."""
    import numpy as np

    times = [t for t, _, _ in steps]
    firsts = [i for i in range(1, len(steps)) if steps[i][1] != steps[i - 1][1]]
    if not firsts:
        return []
    width = float(np.median([times[f] - s for s, f in zip(swap_called, firsts)]))
    out = []
    for n, first in enumerate(firsts):
        t = times[min(first + 2, len(times) - 1)]
        end = load_started[n + 1] if n + 1 < len(load_started) else times[-1]
        while width > 0 and t + width < end:
            out.append(_excess(times, gaps, base, t, t + width))
            t += width / 2
    return out


def _tiny_target():
    import torch

    from serving.target import tiny_target

    t = tiny_target(vocab_size=256, hidden_size=64, num_layers=4, seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # untied random head: tied tiny models only repeat the last token
        t.model.lm_head.weight = torch.nn.Parameter(torch.randn(256, 64, generator=gen) * 0.5)
    t.model.config.tie_word_embeddings = False
    return t


def _register_versions(target, tmp: Path, registry, tenant: str, sizes: list[float]) -> list[str]:
    """Two versions (1 and 2 layers) registered for ``tenant``; their artifacts' MB go to ``sizes``."""
    from feedback.drafters.standalone_lm import StandaloneConfig, standalone_from_target
    from feedback.registry.artifact import save_drafter
    from feedback.registry.shared_tensors import shared_with_target

    vocab = int(target.model.get_output_embeddings().weight.shape[0])
    versions = []
    for layers in (1, 2):
        model = standalone_from_target(target.model, num_layers=layers)
        model.get_input_embeddings().weight.requires_grad_(False)  # as the trainer's student keeps it
        cfg = StandaloneConfig.for_target(target.model.config, num_layers=layers, vocab_size=vocab)
        save_drafter(model, cfg, target.fingerprint, tmp / f"l{layers}", version=f"l{layers}",
                     from_target=shared_with_target(model, target.model))
        sizes.append(round(sum(f.stat().st_size for f in (tmp / f"l{layers}").iterdir()) / 1e6, 1))
        rid = registry.log_candidate(target.fingerprint, tmp / f"l{layers}")
        versions.append(registry.register(tenant, rid).version)
    return versions


def _target_only(target, prompts: list[list[int]], max_tokens: int, bf16_activations: bool) -> dict[int, tuple]:
    """Each prompt's target-only greedy output, the yardstick of ``lossless``: Hugging Face's
    (fp32 activations), or on bf16 activations a k = 0 engine's of the same arithmetic."""
    from benchmarks.runner import collect
    from serving.engine.base import GenerationRequest, SamplingParams
    from serving.engine.config import EngineConfig
    from serving.engine.reference import target_greedy_reference
    from serving.engine.torch_engine import TorchEngine

    if not bf16_activations:
        return {p: tuple(target_greedy_reference(target.model, ids, max_tokens)) for p, ids in enumerate(prompts)}
    engine = TorchEngine(target, None, EngineConfig(k=0, max_batch_size=1, bf16_activations=True))

    async def main() -> dict[int, tuple]:
        await engine.start()
        try:
            out = {}
            for p, ids in enumerate(prompts):
                req = GenerationRequest(request_id=f"ref-{p}", prompt_ids=ids,
                                        params=SamplingParams(max_tokens=max_tokens, ignore_eos=True))
                out[p] = tuple((await collect(engine, req))[0])
            return out
        finally:
            await engine.stop()

    return asyncio.run(main())


def run_bench(tiny: bool, swaps: int, concurrency: int, max_tokens: int, k: int,
              swap_every_s: float, bf16_activations: bool = False) -> dict:
    with tempfile.TemporaryDirectory(prefix="specloop-bench-swap-") as tmp:  # registry + artifacts
        out = _run_bench(tiny, swaps, concurrency, max_tokens, k, swap_every_s, Path(tmp), bf16_activations)
    out["bf16_activations"] = rounds_on_this_cpu(bf16_activations)
    return out


def _run_bench(tiny: bool, swaps: int, concurrency: int, max_tokens: int, k: int,
               swap_every_s: float, tmp: Path, bf16_activations: bool = False) -> dict:
    import logging

    import torch

    from feedback.registry.drafter_registry import DrafterRegistry
    from serving.artifact_loader import ArtifactDrafterLoader
    from serving.drafters.factory import build_drafter
    from serving.engine.base import GenerationRequest, SamplingParams
    from serving.engine.config import EngineConfig
    from serving.engine.torch_engine import TorchEngine
    from serving.live_acceptance import LiveAcceptance
    from serving.swap import SwapConfig, Swapper
    from serving.target import load_target

    logging.getLogger("mlflow").setLevel(logging.WARNING)
    torch.set_num_threads(2)
    target = _tiny_target() if tiny else load_target()
    if tiny:
        prompts = [[(11 * i + j) % 256 for j in range(8 + 3 * i)] for i in range(8)]
    else:
        tok = target.tokenizer
        texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                         add_generation_prompt=True) for p in _TEXT_PROMPTS]
        prompts = [list(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]

    registry = DrafterRegistry(f"sqlite:///{tmp}/mlflow.db")
    artifact_mb: list[float] = []
    versions = _register_versions(target, tmp, registry, "bench", artifact_mb)

    clock, live = _StepClock(), LiveAcceptance()
    engine = TorchEngine(target, build_drafter("standalone", target, num_layers=1),
                         config=EngineConfig(max_batch_size=concurrency, k=k, bf16_activations=bf16_activations),
                         observers=[live, clock])
    swapper = Swapper(engine, ArtifactDrafterLoader(target, "standalone"), live, registry=registry,
                      config=SwapConfig(tenant="bench", floor_ratio=0.0, poll_interval_s=0,
                                        log_interval_s=3600))
    swap_called: list[float] = []  # when the Swapper handed each drafter to the engine
    load_started: list[float] = []
    handover_ms: list[float] = []  # how long swap_drafter took (preparing the drafter, if it does)
    engine_swap = engine.swap_drafter

    def timed_swap(drafter):
        # Let the step in progress (slowed by the artifact load on the same cores) end first, so
        # that the load's cost is not counted as the engine's: no effect on the engine's work.
        seen, t0 = len(clock.steps), time.perf_counter()
        while len(clock.steps) == seen and time.perf_counter() - t0 < 5.0:
            time.sleep(0.001)
        swap_called.append(time.perf_counter())
        engine_swap(drafter)
        handover_ms.append((time.perf_counter() - swap_called[-1]) * 1000.0)

    engine.swap_drafter = timed_swap
    prefills: list[tuple[float, float]] = []  # admissions, taken out of the step gaps
    engine_prefill = engine._prefill

    def timed_prefill(prompt_ids):
        t0 = time.perf_counter()
        try:
            return engine_prefill(prompt_ids)
        finally:
            prefills.append((t0, time.perf_counter()))

    engine._prefill = timed_prefill
    outputs: dict[int, set[tuple[int, ...]]] = {}
    failed = completed = 0
    errors: list[str] = []
    done = threading.Event()

    def swap_loop():
        for i in range(swaps):
            if done.wait(swap_every_s):
                return
            load_started.append(time.perf_counter())
            swapper.swap_to(versions[i % 2], reason="bench")
        done.set()

    async def client(c: int):
        nonlocal failed, completed
        n = 0
        while not done.is_set():
            p = (c + n * concurrency) % len(prompts)
            n += 1
            req = GenerationRequest(request_id=f"c{c}-{n}", prompt_ids=prompts[p],
                                    params=SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            try:
                out = [t async for ch in engine.generate(req) for t in ch.token_ids]
                outputs.setdefault(p, set()).add(tuple(out))
                completed += 1
            except Exception as e:  # noqa: BLE001
                failed += 1
                errors.append(repr(e))
                if failed > 100:  # something is systematically wrong: stop, report it
                    done.set()

    async def main():
        await engine.start()
        swapper.start()
        try:
            t = asyncio.get_running_loop().run_in_executor(None, swap_loop)
            await asyncio.gather(*[client(c) for c in range(concurrency)], t)
        finally:
            swapper.stop()
            await engine.stop()

    t0 = time.perf_counter()
    asyncio.run(main())
    wall = time.perf_counter() - t0
    gaps = _gaps_ms(clock.steps, prefills)
    installs, base = _stall_ms(clock.steps, gaps)
    stalls = _window_stalls(clock.steps, gaps, base, swap_called, None)
    loads = _window_stalls(clock.steps, gaps, base, load_started, swap_called)
    nulls = _null_stalls(clock.steps, gaps, base, swap_called, load_started)
    import numpy as np

    def pct(xs, q):
        return round(float(np.percentile(xs, q)), 2) if xs else None

    references = _target_only(target, prompts, max_tokens, bf16_activations)
    lossless = all(outs == {references[p]} for p, outs in outputs.items())
    return {
        "model": target.model_id,
        "swaps": len(stalls),
        "swaps_requested": swaps,
        "failed_requests": failed,
        "stall_p99_ms": pct(stalls, 99),
        "stall_median_ms": pct(stalls, 50),
        "stall_ms": [round(x, 1) for x in stalls],
        "load_stall_ms": [round(x, 1) for x in loads],
        "install_stall_p99_ms": pct(installs, 99),
        "install_stall_median_ms": pct(installs, 50),
        "load_stall_p99_ms": pct(loads, 99),
        "load_stall_median_ms": pct(loads, 50),
        "null_stall_p99_ms": pct(nulls, 99),
        "null_windows": len(nulls),
        "handover_median_ms": pct(handover_ms, 50),
        "fetch_median_ms": pct([(call - load) * 1000.0 for load, call in zip(load_started, swap_called, strict=False)], 50),
        "artifact_mb": artifact_mb,
        "step_median_ms": round(base, 2),
        "lossless": lossless,
        "requests": completed,
        "first_error": errors[0] if errors else None,
        "concurrency": concurrency,
        "steps": len(clock.steps),
        "wall_s": round(wall, 1),
    }


def bench_swap(
    json_out: bool = json_option(),
    tiny: bool = typer.Option(False, "--tiny", help="Tiny random Llama instead of SmolLM2-135M."),
    swaps: int = typer.Option(10, help="Swaps to perform (alternating two versions)."),
    concurrency: int = typer.Option(4, help="Concurrent clients (= engine batch size)."),
    max_tokens: int = typer.Option(48, help="Tokens per request."),
    k: int = typer.Option(4, help="Draft length."),
    swap_every_s: float = typer.Option(1.0, help="Seconds between swaps."),
    bf16_activations: bool = bf16_activations_option(),
) -> None:
    """Swap drafters repeatedly under concurrent load; print swaps, failed_requests, stall_p99_ms."""
    result = run_bench(tiny, swaps, concurrency, max_tokens, k, swap_every_s, bf16_activations)
    print_json(result, json_out)
