"""Drive a TorchEngine over a list of prompts and collect what benchmarks report.

Requests are sent one after another (latency-bound decoding, where speculative decoding pays) or
with a fixed concurrency. Step timings come from the engine's VerifyBatch stream.
"""

from __future__ import annotations

import asyncio
import time
import uuid
import zlib
from array import array
from dataclasses import dataclass, field

import numpy as np

from infra.measure import collect, median_ms  # noqa: F401  (re-exported for the benchmarks)
from serving.engine.base import GenerationRequest, SamplingParams, VerifyBatch
from serving.observers import BaseObserver


def check_precision(value: str) -> str:
    """Typer callback of the benchmarks' ``--precision`` (the trainer's): refused before any work."""
    import typer

    from trainer.distill import PRECISIONS

    if value not in PRECISIONS:
        raise typer.BadParameter(f"{value!r}: choose one of {', '.join(PRECISIONS)}")
    return value


class StepTimer(BaseObserver):
    """Collects per-step timings and draft counts."""

    def __init__(self):
        self.draft_ms: list[float] = []
        self.verify_ms: list[float] = []
        self.rows: list[int] = []
        self.drafted: list[int] = []
        self.accepted: list[int] = []
        self.nodes: list[int] = []
        """Drafted nodes per step (tree nodes, or chain drafts), summed over rows."""
        self.tree_steps = 0
        self.stamps: list[float] = []
        """When each step reported (perf_counter): the interval before a step is its whole period
        (draft, forward, bookkeeping, and any admission and prefill in between)."""
        self.opens: list[bool] = []
        """The step opened a segment (``new_segment``): the interval before it is not its own."""
        self._open = True

    def on_step(self, batch: VerifyBatch) -> None:
        self.stamps.append(time.perf_counter())
        self.opens.append(self._open)
        self._open = False
        self.draft_ms.append(batch.draft_ms)
        self.verify_ms.append(batch.verify_ms)
        self.rows.append(len(batch.request_ids))
        self.drafted.append(int(np.asarray(batch.num_drafted).sum()))
        self.accepted.append(int(np.asarray(batch.num_accepted).sum()))
        self.tree_steps += batch.tree_nodes is not None
        self.nodes.append(int(np.asarray(batch.draft_nodes).sum()))

    def reset(self) -> None:
        self.__init__()

    def new_segment(self) -> None:
        """The engine was idle (or another one ran) since the last step: do not time the gap."""
        self._open = True

    def full_batch_rate(self, rows: int) -> tuple[float, float] | None:
        """(tokens per second, seconds) over the steps that ran exactly ``rows`` rows, each timed
        from the previous step's report: the throughput while the batch is full, without the
        ramp-up and the tail of a finite prompt list (where speculative rows, which advance
        unevenly, leave one by one and the last ones run at a small batch)."""
        tokens, seconds = 0, 0.0
        for i in range(1, len(self.stamps)):
            if self.rows[i] == rows and not self.opens[i]:
                tokens += self.rows[i] + self.accepted[i]
                seconds += self.stamps[i] - self.stamps[i - 1]
        return (tokens / seconds, seconds) if seconds > 0 else None

    def between_steps_s(self) -> float:
        """Seconds between the steps (each step's period less its draft and verify), summed over
        the timed intervals: admissions with their prefills, streaming and bookkeeping."""
        gap = 0.0
        for i in range(1, len(self.stamps)):
            if not self.opens[i]:
                gap += self.stamps[i] - self.stamps[i - 1] - (self.draft_ms[i] + self.verify_ms[i]) / 1e3
        return gap

    def plain_step_ms(self, rows: int) -> float | None:
        """Median verify ms of the steps of ``rows`` rows that drafted nothing: the same work in
        two engines, so a gap between them is the machine's drift, not speculation."""
        ms = [v for v, r, n in zip(self.verify_ms, self.rows, self.nodes) if r == rows and n == 0]
        return float(np.median(ms)) if ms else None

    def summary(self) -> dict:
        steps = len(self.verify_ms)
        drafted = sum(self.drafted)
        return {
            "steps": steps,
            "drafted": drafted,
            "accepted": sum(self.accepted),
            "verify_ms": float(np.mean(self.verify_ms)) if steps else 0.0,
            "draft_ms_per_step": float(np.mean(self.draft_ms)) if steps else 0.0,
            "draft_ms_per_token": float(sum(self.draft_ms) / drafted) if drafted else 0.0,
            "nodes_per_row_step": float(sum(self.nodes) / sum(self.rows)) if steps else 0.0,
            "tree_step_fraction": self.tree_steps / steps if steps else 0.0,
        }


@dataclass
class RunResult:
    outputs: list[list[int]] = field(default_factory=list)
    wall_s: float = 0.0
    tokens: int = 0
    verify_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    failed: int = 0
    cached_prompt_tokens: int = 0
    """Prompt tokens the engine's prefix cache served instead of prefilling (TorchEngine's
    ``runner.prefix_cache``; 0 for engines without one). Two engines compared on the same prompts
    do the same prefill work only when these are equal."""

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0

    @property
    def mean_accept_len(self) -> float:
        return self.tokens / self.verify_steps if self.verify_steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


async def _one(engine, prompt_ids: list[int], params: SamplingParams, domain: str | None,
               tenant: str, train: bool) -> tuple[list[int], object]:
    request = GenerationRequest(
        request_id=f"bench-{uuid.uuid4().hex[:12]}", prompt_ids=prompt_ids, params=params,
        tenant=tenant, domain=domain, train=train,
    )
    tokens, last = await collect(engine, request)
    return tokens, last.stats if last is not None else None


async def run_prompts(
    engine,
    prompts: list[list[int]],
    max_tokens: int,
    *,
    domains: list[str | None] | None = None,
    concurrency: int = 1,
    temperature: float = 0.0,
    tenant: str = "default",
    train: bool = True,
    on_done=None,
) -> RunResult:
    """Generate every prompt (greedy by default) and total up tokens, time and spec stats. A
    sampled run (``temperature`` > 0) seeds each request from its prompt (``prompt_seed``): the
    engines sample position-keyed (serving/engine/seeded.py), so a speculative run and a
    target-only one of the same prompt still emit the same tokens, and lossless stays token identity."""
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature)
    domains = domains or [None] * len(prompts)
    result = RunResult(outputs=[[] for _ in prompts])
    sem = asyncio.Semaphore(concurrency)

    async def task(i: int) -> None:
        async with sem:
            try:
                seeded = params if temperature <= 0 else params.model_copy(update={"seed": prompt_seed(prompts[i])})
                tokens, stats = await _one(engine, prompts[i], seeded, domains[i], tenant, train)
            except Exception:  # noqa: BLE001 - a benchmark counts failures, it does not stop
                result.failed += 1
                return
            result.outputs[i] = tokens
            result.tokens += len(tokens)
            if stats is not None:
                result.verify_steps += stats.verify_steps
                result.drafted += stats.drafted_tokens
                result.accepted += stats.accepted_tokens
            if on_done is not None:
                on_done(i, tokens)

    cached_before = prefix_hits(engine)
    t0 = time.perf_counter()
    await asyncio.gather(*(task(i) for i in range(len(prompts))))
    result.wall_s = time.perf_counter() - t0
    result.cached_prompt_tokens = prefix_hits(engine) - cached_before
    return result


def prompt_seed(prompt_ids: list[int]) -> int:
    """A sampled request's seed, the same for the same prompt in every run and engine."""
    return zlib.crc32(array("q", prompt_ids).tobytes())


def prefix_hits(engine) -> int:
    """Prompt tokens served from ``engine``'s prefix cache so far (0 without one)."""
    prefixes = getattr(getattr(engine, "runner", None), "prefix_cache", None)
    return prefixes.hit_tokens if prefixes is not None else 0
