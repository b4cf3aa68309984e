"""Baselines served beside the loop, request by request (infra/paired_serving.py)."""

import asyncio

import torch

from infra.loop import LoopConfig, OnlineLoop
from infra.paired_serving import serve_paired, target_only_loop, warmed
from serving.target import tiny_target

V = 128


def test_twinned_positions_are_served_beside_the_loop_in_mirrored_order():
    target = tiny_target(vocab_size=V, hidden_size=32, num_layers=2, seed=0)
    g = torch.Generator().manual_seed(0)
    items = [(torch.randint(0, V, (10,), generator=g).tolist(), "chat") for _ in range(5)]
    seen = []

    async def run():
        loop = await warmed(OnlineLoop(target, None, LoopConfig(drafter="suffix", k=3, train=False, max_tokens=6)),
                            items)
        base = await target_only_loop(target, items, 6)
        try:
            await serve_paired(loop, items, 0, seen.append, [base], twin={1, 2, 4}.__contains__)
        finally:
            await loop.stop()
            await base.stop()
        return loop, base

    loop, base = asyncio.run(run())
    assert seen == loop.points and len(loop.points) == 5  # on_point sees the loop's points only
    assert len(base.points) == 3 and [p.output for p in base.points] == [loop.points[i].output for i in (1, 2, 4)]
    base_first = [b.done_at < loop.points[i].done_at for i, b in zip((1, 2, 4), base.points)]
    assert base_first == [True, False, False]  # odd positions: the baseline first
