"""Outbox: the step thread's replies wait for the next forward's layers, and lose nothing."""

from __future__ import annotations

import asyncio

import pytest

from serving.engine.base import GenerationRequest
from serving.engine.config import EngineConfig
from serving.engine.outbox import Outbox
from serving.engine.reference import target_greedy_reference
from serving.engine.rows import Client
from serving.engine.torch_engine import TorchEngine


def test_held_replies_reach_their_clients_in_order_and_a_closed_loop_is_refused():
    async def main():
        loop = asyncio.get_running_loop()
        a, b = Client(loop, asyncio.Queue()), Client(loop, asyncio.Queue())
        box = Outbox()
        for i in range(3):
            assert box.send(a, f"a{i}") and box.send(b, f"b{i}")
        await asyncio.sleep(0.01)
        assert a.queue.empty() and len(box) == 6  # held, not handed over
        box.flush()
        await asyncio.sleep(0.01)
        assert len(box) == 0
        return [a.queue.get_nowait() for _ in range(3)], [b.queue.get_nowait() for _ in range(3)]

    got_a, got_b = asyncio.run(main())
    assert got_a == ["a0", "a1", "a2"] and got_b == ["b0", "b1", "b2"]

    closed = asyncio.new_event_loop()
    closed.close()
    box = Outbox()
    assert not box.send(Client(closed, None), "x") and len(box) == 0  # the engine aborts that row


@pytest.mark.parametrize("forward", ["auto", "hf"])
def test_a_steps_chunks_are_handed_over_when_the_next_forward_runs_its_layers(ids_target, run, drafters, helpers,
                                                                              forward):
    """Each draft runs while the previous step's chunks are still held (the client's event loop
    does not take the GIL from it), the forward's layers start with them handed over, and every
    request still gets all its tokens, in order, lossless: on our forward and on Hugging Face's."""
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
    refs = [target_greedy_reference(ids_target.model, p, 12) for p in prompts]
    held_at_propose: list[int] = []
    engine: TorchEngine | None = None

    class Watching(drafters.Garbage):
        def propose(self, views, k):
            held_at_propose.append(len(engine._outbox))
            return super().propose(views, k)

    vocab = int(ids_target.model.config.vocab_size)
    engine = TorchEngine(ids_target, Watching(vocab), EngineConfig(k=2, max_batch_size=2, forward=forward))
    assert (engine.runner.fast is None) == (forward == "hf")
    flushed_before_layers: list[int] = []
    forward = engine.runner.forward

    def watched_forward(*args, before_layers=None, **kw):
        def hand_over():
            flushed_before_layers.append(len(engine._outbox))
            before_layers()
            assert len(engine._outbox) == 0

        return forward(*args, before_layers=hand_over if before_layers else None, **kw)

    engine.runner.forward = watched_forward
    requests = [GenerationRequest(request_id=f"r{i}", prompt_ids=p, params=helpers.greedy(12))
                for i, p in enumerate(prompts)]
    results = run(engine, requests)
    assert [helpers.tokens_of(chunks) for chunks in results] == refs
    assert all(chunks[-1].finished for chunks in results)
    # after a step, its chunks wait through the next draft and reach the loop at the layers
    assert len(flushed_before_layers) == engine.steps >= 12  # (the last step drafts nothing)
    assert sum(n > 0 for n in held_at_propose) >= engine.steps - 3  # all but the first and last
    assert sum(n > 0 for n in flushed_before_layers) >= engine.steps - 2
    assert len(engine._outbox) == 0  # nothing left behind once the batch emptied
