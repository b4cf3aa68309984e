"""Small measuring helpers shared by the closed loop (infra/loop.py), the gate's cost measurement
(infra/costs.py) and the benchmarks."""

from __future__ import annotations

import time

import numpy as np

from serving.engine.base import GenerationChunk, GenerationRequest


async def collect(engine, request: GenerationRequest) -> tuple[list[int], GenerationChunk | None]:
    """Stream one request to its end: (every output token, the final chunk with the stats)."""
    tokens: list[int] = []
    last = None
    async for chunk in engine.generate(request):
        tokens.extend(chunk.token_ids)
        last = chunk
    return tokens, last


def median_ratio(fn, base, iters: int = 12, warmup: int = 1) -> float:
    """Median over ``iters`` pairs of ``fn()``'s wall time over ``base()``'s, each pair timed back
    to back (``base`` first, so ``fn`` finds the caches as after it). A ratio of two medians taken
    one after the other carries the machine's drift between them: on a 2-core VM the trainer's
    gate read a 2-token verify at 0.92 of a one-token step in one run and 1.15 in the next."""
    for _ in range(warmup):
        base()
        fn()
    ratios = []
    for _ in range(iters):
        t0 = time.perf_counter()
        base()
        t1 = time.perf_counter()
        fn()
        t2 = time.perf_counter()
        ratios.append((t2 - t1) / max(t1 - t0, 1e-9))
    return float(np.median(ratios))


def median_ms(fn, iters: int = 20, warmup: int = 3) -> float:
    """Median wall milliseconds of ``fn()`` over ``iters`` calls, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1000.0)
