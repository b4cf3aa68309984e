"""``specloop bench capture``: the serving cost of trace capture and export to Kafka.

It starts a tansu broker of its own (stopped at the end) and serves the same workload (the same
prompts, greedy, the same concurrency, a fresh suffix drafter and engine per run) in two arms:

- ``capture``: a TraceRecorder -> KafkaTraceSink on the engine (the engine then also computes the
  target top-k for the traces; with ``features`` it also captures target hidden states);
- ``none``: no TraceRecorder at all (no observer wants top-k, so the engine skips it).

The arms alternate (none, capture, capture, none, ...) over ``repeats`` pairs, after one untimed
warm-up of each, so slow drifts and noisy neighbours hit both alike. ``overhead_pct`` is the
median over pairs of the throughput lost by capture; the totals-based figure is reported too.
Trace delivery (flush) happens between runs, outside the timed part; whatever the sink could not
deliver counts in ``shed``.

The paired figure moves by several percent between pairs of ~10 s on a shared VM, more than
capture costs, so the capture arm also measures that cost directly, in the same runs:
``capture_step_thread_pct`` is the share of its wall time the decode steps' thread spent on the
trace (the target top-k, ``VerifyBatch.trace_ms``, and the recorder's callbacks, which hand the
finished record to the sink), and ``capture_export_cpu_pct`` the CPU time of the threads that
export it (the sink's sender, which encodes, and the Kafka producer's network thread, which
compresses and sends) over the same wall time: off the step thread, but on the same cores.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import statistics
import tempfile
import threading
import time
import uuid
from pathlib import Path

import torch

from benchmarks.runner import RunResult, run_prompts
from infra.loop_metrics import paired_speedup_interval, rounds_on_this_cpu
from infra.prompts import PromptItem, interleave_categories, load_prompts, split_by_domain

log = logging.getLogger(__name__)


def select_prompts(items: list[PromptItem], limit: int) -> list[PromptItem]:
    """``limit`` prompts, round-robin over domains and, within a domain, over categories."""
    queues = [interleave_categories(group) for group in split_by_domain(items).values()]
    out: list[PromptItem] = []
    while len(out) < limit and any(queues):
        for q in queues:
            if q and len(out) < limit:
                out.append(q.pop(0))
    return out


def _timed_recorder(sink, fingerprint, features: bool):
    """A TraceRecorder that adds up the step thread's time in its callbacks and in each step's
    trace top-k (``seconds``)."""
    from serving.observers import TraceRecorder

    class TimedRecorder(TraceRecorder):
        seconds = 0.0

        def on_request_start(self, request, prefill_features=None) -> None:
            t0 = time.perf_counter()
            super().on_request_start(request, prefill_features)
            self.seconds += time.perf_counter() - t0

        def on_step(self, batch) -> None:
            t0 = time.perf_counter()
            super().on_step(batch)
            self.seconds += time.perf_counter() - t0 + (batch.trace_ms or 0.0) / 1e3

        def on_request_finish(self, request, output_ids, finish_reason, stats) -> None:
            t0 = time.perf_counter()
            super().on_request_finish(request, output_ids, finish_reason, stats)
            self.seconds += time.perf_counter() - t0

    return TimedRecorder(sink, fingerprint, record_features=features)


def thread_cpu_s(name_parts: tuple[str, ...]) -> float:
    """CPU seconds (user + system) so far of this process's threads whose names contain one of
    ``name_parts`` (Linux /proc; 0 elsewhere)."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    total = 0.0
    for thread in threading.enumerate():
        if not any(part in thread.name for part in name_parts) or not thread.native_id:
            continue
        try:
            stat = Path(f"/proc/self/task/{thread.native_id}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # from field 3 (state) on
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


_EXPORT_THREADS = ("kafka-trace-sink", "-network-thread")
"""The sink's sender thread and kafka-python's producer network thread (``<client_id>-network-thread``)."""


async def _one_run(target, sink, arm: str, prompts, domains, *, max_tokens: int, k: int,
                   concurrency: int, features: bool, bf16_activations: bool = False) -> tuple[RunResult, dict]:
    """One arm's run: its result, and for the capture arm the trace path's own cost in it."""
    from serving.drafters.factory import build_drafter
    from serving.engine.config import EngineConfig
    from serving.engine.torch_engine import TorchEngine

    capture = arm == "capture"
    recorder = _timed_recorder(sink, target.fingerprint, features) if capture else None
    config = EngineConfig(k=k, max_batch_size=concurrency, capture_features=capture and features,
                          bf16_activations=bf16_activations)
    engine = TorchEngine(target, build_drafter("suffix", target), config,
                         observers=[recorder] if recorder else [])
    await engine.start()
    try:
        cpu0 = thread_cpu_s(_EXPORT_THREADS)
        res = await run_prompts(engine, prompts, max_tokens, domains=domains, concurrency=concurrency)
        # outside the timed run; the export of this run's traces, whenever it happens, is this run's
        if capture and not sink.flush(60):
            log.warning("traces still pending after 60 s")
        cost = {}
        if recorder is not None and res.wall_s:
            cost = {"step_thread_pct": 100.0 * recorder.seconds / res.wall_s,
                    "export_cpu_pct": 100.0 * (thread_cpu_s(_EXPORT_THREADS) - cpu0) / res.wall_s}
        return res, cost
    finally:
        await engine.stop()


async def bench_capture_async(items: list[PromptItem], *, tiny: bool = False, limit: int = 8,
                              max_tokens: int = 64, k: int = 4, concurrency: int = 4,
                              repeats: int = 3, features: bool = False,
                              dtype: str = "bfloat16", bf16_activations: bool = False) -> dict:
    from feedback.bus.kafka_sink import KafkaTraceSink
    from infra.stack import Stack
    from serving.target import load_target, tiny_target

    target = tiny_target() if tiny else load_target(dtype=getattr(torch, dtype))
    chosen = select_prompts(items, limit)
    prompts = [p.token_ids(target.tokenizer) for p in chosen]
    domains = [p.domain for p in chosen]

    run_dir = tempfile.mkdtemp(prefix="specloop-bench-capture-")
    stack = Stack(run_dir)
    try:
        broker = stack.start_broker(storage="memory")
        topic = f"specloop.traces.bench-{uuid.uuid4().hex[:8]}"
        sink = KafkaTraceSink(bootstrap_servers=broker.url, topic=topic)
        try:
            run = lambda arm, n_tokens=max_tokens: _one_run(
                target, sink, arm, prompts, domains, max_tokens=n_tokens, k=k,
                concurrency=concurrency, features=features, bf16_activations=bf16_activations)
            # Warm-up (untimed): allocator, kernels, producer connection, topic creation.
            for arm in ("none", "capture"):
                await run(arm, min(max_tokens, 16))  # (its result and cost are not kept)
            if not sink.flush(30):
                log.warning("warm-up traces not delivered within 30 s")
            sent0, bytes0, shed0, emitted0 = sink.sent, sink.sent_bytes, sink.shed, sink.emitted

            results: dict[str, list[RunResult]] = {"none": [], "capture": []}
            costs: list[dict] = []
            for r in range(repeats):
                for arm in ("none", "capture") if r % 2 == 0 else ("capture", "none"):
                    res, cost = await run(arm)
                    results[arm].append(res)
                    if cost:
                        costs.append(cost)
                    log.info("pair %d %-7s %.2f tok/s (%d tokens, %.2f s)", r, arm, res.tok_s,
                             res.tokens, res.wall_s)
            sink.flush(30)
        finally:
            sink.close()
    finally:
        stack.down()
        shutil.rmtree(run_dir, ignore_errors=True)

    base, cap = results["none"], results["capture"]
    base_tok_s, cap_tok_s = _tok_s(base), _tok_s(cap)
    sent = sink.sent - sent0
    cap_wall = sum(x.wall_s for x in cap)
    return {
        **overhead_figures(base, cap),
        "capture_step_thread_pct": _median_of(costs, "step_thread_pct"),
        "capture_export_cpu_pct": _median_of(costs, "export_cpu_pct"),
        "traces_per_s": round(sent / cap_wall, 2) if cap_wall else 0.0,
        "bytes_per_trace": round((sink.sent_bytes - bytes0) / sent) if sent else 0,
        "shed": sink.shed - shed0,
        "emitted": sink.emitted - emitted0,
        "sent": sent,
        "capture_tok_s": round(cap_tok_s, 3),
        "none_tok_s": round(base_tok_s, 3),
        "capture_tok_s_runs": [round(x.tok_s, 3) for x in cap],
        "none_tok_s_runs": [round(x.tok_s, 3) for x in base],
        "outputs_identical": all(c.outputs == b.outputs for b, c in zip(base, cap)),
        "failed": sum(x.failed for x in base + cap),
        "model": target.model_id,
        "features": features,
        "prompts": len(prompts),
        "max_tokens": max_tokens,
        "tokens_per_run": cap[0].tokens if cap else 0,
        "verify_steps_per_run": cap[0].verify_steps if cap else 0,
        "concurrency": concurrency,
        "k": k,
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "dtype": str(next(target.model.parameters()).dtype).removeprefix("torch."),
    }


def overhead_figures(base: list[RunResult], cap: list[RunResult]) -> dict:
    """Throughput lost to capture, from the paired runs (``base[i]`` and ``cap[i]`` served back to
    back): the median over pairs, the figure over all runs' totals, each pair's, and a bootstrap
    interval over the pairs (``overhead_pct_ci95``, infra/loop_metrics.paired_speedup_interval):
    on this VM a pair moves by +-15 % at times, more than capture costs, and the interval says
    whether a run could tell its overhead from zero at all."""
    pair_overheads = [100.0 * (1.0 - c.tok_s / b.tok_s) for b, c in zip(base, cap) if b.tok_s]
    base_tok_s, cap_tok_s = _tok_s(base), _tok_s(cap)
    ratio = paired_speedup_interval(cap, base)  # [low, high] of capture / none throughput
    return {
        "overhead_pct": round(statistics.median(pair_overheads), 2) if pair_overheads else None,
        "overhead_pct_ci95": None if ratio is None else [round(100.0 * (1.0 - ratio[1]), 2),
                                                         round(100.0 * (1.0 - ratio[0]), 2)],
        "overhead_pct_total": round(100.0 * (1.0 - cap_tok_s / base_tok_s), 2) if base_tok_s else None,
        "overhead_pct_pairs": [round(x, 2) for x in pair_overheads],
    }


def _tok_s(runs: list[RunResult]) -> float:
    wall = sum(x.wall_s for x in runs)
    return sum(x.tokens for x in runs) / wall if wall else 0.0


def _median_of(costs: list[dict], key: str) -> float | None:
    values = [c[key] for c in costs if key in c]
    return round(statistics.median(values), 3) if values else None


def run(prompts: str | None, tiny: bool, limit: int, max_tokens: int, k: int, concurrency: int,
        repeats: int, features: bool, threads: int | None, dtype: str,
        bf16_activations: bool = False) -> dict:
    if threads:
        torch.set_num_threads(threads)
    # SIGTERM unwinds like Ctrl-C, so the broker we started is stopped on the way out.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    items = load_prompts(prompts)
    t0 = time.perf_counter()
    out = asyncio.run(bench_capture_async(
        items, tiny=tiny, limit=limit, max_tokens=max_tokens, k=k, concurrency=concurrency,
        repeats=repeats, features=features, dtype=dtype, bf16_activations=bf16_activations))
    out["bf16_activations"] = rounds_on_this_cpu(bf16_activations)
    out["bench_wall_s"] = round(time.perf_counter() - t0, 1)
    return out


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)
