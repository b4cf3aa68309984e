"""bench online's fair baseline: a static drafter trained offline on the pre-shift responses."""

import asyncio
from types import SimpleNamespace

import pytest
import torch

from benchmarks.bench_online import heldout_acceptance, is_heldout, serve_stream, static_drafter
from infra.loop import LoopConfig, OnlineLoop
from serving.target import tiny_target

V = 256


@pytest.fixture(scope="module")
def target():
    return tiny_target(vocab_size=V, hidden_size=64, num_layers=4, seed=0)


def stream(n, domain, seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, V, (12,), generator=g).tolist(), domain) for _ in range(n)]


@pytest.mark.parametrize("kind", ["standalone", "hybrid"])
def test_static_drafter_is_the_same_kind_trained_on_pre_shift_outputs(kind, target):
    cfg = LoopConfig(drafter=kind, train=False, k=3, max_tokens=10, day0_init="selfspec", draft_vocab_size=128,
                     selfspec_exit_layer=1)
    loop = OnlineLoop(target, None, cfg)
    items = stream(10, "chat", 0)

    async def run():
        await loop.start()
        try:
            await serve_stream(loop, items, 0)
            loop.snapshot()
        finally:
            await loop.stop()

    asyncio.run(run())
    assert not any(p.failed for p in loop.points)
    plain = OnlineLoop(target, None, LoopConfig(k=0, train=False, max_tokens=10))

    async def run_plain():
        await plain.start()
        try:
            await plain.serve(items)
        finally:
            await plain.stop()

    asyncio.run(run_plain())
    assert [p.output for p in loop.points] == [p.output for p in plain.points]  # selfspec drafts are lossless
    drafter, fit = static_drafter(target, loop, cfg, steps=4)
    assert fit["traces"] == 10 and fit["train_steps"] >= 1
    inner = drafter.inner
    learned = inner.learned if kind == "hybrid" else inner
    assert learned.kind == "selfspec" and learned.version == "static"
    if kind == "hybrid":
        assert inner.suffix.kind == "suffix"
    # the held-out figure scores the learned model on the requests served with train: false
    assert [p.index for p in loop.points if is_heldout(p.index)] == [4, 9]
    acc = heldout_acceptance(loop, drafter=learned)
    assert set(acc) == {"chat"} and 0.0 <= acc["chat"] <= 1.0
    # the target itself as the "learned" model accepts (almost) every held-out token
    oracle = SimpleNamespace(model=target.model, net=SimpleNamespace(vocab_map=None))
    assert heldout_acceptance(loop, drafter=oracle)["chat"] >= 0.95


def test_the_hybrid_and_the_learned_only_kind_share_one_static_fit(target, tmp_path):
    """Both kinds' static baselines are the same student trained from the same start on the same
    pre-shift responses: the second kind loads the first one's artifact instead of training again."""
    from benchmarks.bench_online import StaticFits

    cfg = LoopConfig(drafter="standalone", train=False, k=3, max_tokens=10, day0_init="selfspec",
                     draft_vocab_size=128, selfspec_exit_layer=1)
    loop = OnlineLoop(target, None, cfg)

    async def run():
        await loop.start()
        try:
            await serve_stream(loop, stream(6, "chat", 1), 0)
            loop.snapshot()
        finally:
            await loop.stop()

    asyncio.run(run())
    fits = StaticFits(tmp_path)
    alone, fit = static_drafter(target, loop, cfg, steps=4, fits=fits)
    hybrid_cfg = LoopConfig(**{**cfg.__dict__, "drafter": "hybrid"})
    hybrid, again = static_drafter(target, loop, hybrid_cfg, steps=4, fits=fits)
    assert "reused" not in fit and again["reused"] is True
    assert again["best_step"] == fit["best_step"] and again["heldout_acceptance"] == fit["heldout_acceptance"]
    learned = hybrid.inner.learned
    for a, b in zip(alone.inner.model.parameters(), learned.model.parameters(), strict=True):
        assert torch.equal(a, b)
    # another recipe (more steps) is trained anew
    _, other = static_drafter(target, loop, cfg, steps=5, fits=fits)
    assert "reused" not in other
    assert len(list(tmp_path.iterdir())) == 2
