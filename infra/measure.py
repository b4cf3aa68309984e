"""Small measuring helpers shared by the closed loop (infra/loop.py) and the benchmarks."""

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


def median_ms(fn, iters: int = 20, warmup: int = 3, between=None) -> float:
    """Median wall milliseconds of ``fn()`` over ``iters`` calls, after ``warmup`` untimed ones.
    ``between``: called untimed before each timed call (e.g. what serving runs between two drafts,
    so that ``fn`` finds the caches as it does there, not warm from its own last call)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if between is not None:
            between()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1000.0)
