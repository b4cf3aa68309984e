"""Serving a stream with its baselines beside it, request by request.

On a 2-core VM the machine's speed drifts by 5-30 % within minutes: a target-only baseline served
before the stream (the demo's, until the twenty-third session) or a static drafter replayed after it
(``bench online``'s ``static_vs_adapted_after_shift``, likewise) reads that drift as speculation's
gain or loss. So each compared request is served on every engine one right after the other, the
loop's first on even stream positions and last on odd ones, the others mirrored around it
(ABBA for two, ABC CBA for three): a drift that is linear over two requests weighs on all alike.
The loops' trainers keep running throughout, so the baselines share their interference too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from infra.loop import LoopConfig, OnlineLoop


async def warmed(loop: OnlineLoop, stream) -> OnlineLoop:
    """Start ``loop`` and serve one short request (its first forwards are slow), then forget it:
    the caller serves on the loop and stops it."""
    await loop.start()
    try:
        await loop.serve([(stream[0][0][:8], stream[0][1])], train=False)
    except BaseException:
        await loop.stop()
        raise
    loop.points.clear()
    loop.served.clear()
    return loop


async def target_only_loop(target, stream, max_tokens: int) -> OnlineLoop:
    """A started, warmed target-only loop (k = 0, no training) with no points yet."""
    return await warmed(OnlineLoop(target, None, LoopConfig(k=0, train=False, max_tokens=max_tokens)), stream)


async def serve_paired(loop: OnlineLoop, items, start: int = 0, on_point=None,
                       beside: Sequence[OnlineLoop] = (), twin: Callable[[int], bool] = lambda i: True,
                       train: Callable[[int], bool] = lambda i: True) -> None:
    """Serve ``items`` (stream positions ``start``...) one at a time through ``loop``, trained on
    where ``train(position)``; every position where ``twin(position)`` is also served, untrained,
    through each of ``beside`` right before or after it (mirrored order, see the module's
    docstring). ``on_point`` sees the loop's points only."""
    for j, item in enumerate(items):
        position = start + j
        others = list(beside) if twin(position) else []
        order = [loop, *others] if position % 2 == 0 else [*reversed(others), loop]
        for each in order:
            if each is loop:
                await loop.serve([item], on_point, train=train(position))
            else:
                await each.serve([item], train=False)
