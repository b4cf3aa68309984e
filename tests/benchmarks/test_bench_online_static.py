"""bench online's fair baseline: a static drafter trained offline on the pre-shift responses."""

import asyncio
from types import SimpleNamespace

import pytest
import torch

from benchmarks.bench_online import (
    adapted_and_frozen,
    heldout_acceptance,
    is_heldout,
    kind_order,
    trained,
)
from benchmarks.static_fits import StaticFits, static_drafter
from infra.loop import LoopConfig, OnlineLoop
from infra.paired_serving import serve_paired, target_only_loop
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
            await serve_paired(loop, items, train=trained)
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
    cfg = LoopConfig(drafter="standalone", train=False, k=3, max_tokens=10, day0_init="selfspec",
                     draft_vocab_size=128, selfspec_exit_layer=1)
    loop = OnlineLoop(target, None, cfg)

    async def run():
        await loop.start()
        try:
            await serve_paired(loop, stream(6, "chat", 1), train=trained)
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


def _served_loop(target, cfg, n=6, seed=1):
    loop = OnlineLoop(target, None, cfg)

    async def run():
        await loop.start()
        try:
            await serve_paired(loop, stream(n, "chat", seed), train=trained)
            loop.snapshot()
        finally:
            await loop.stop()

    asyncio.run(run())
    return loop


def test_the_static_fit_trains_in_a_process_of_its_own_while_other_work_is_served(target, tmp_path):
    """``StaticFits.start`` fits in a spawned process (which loads the target itself); the kind
    that asks for it later gets that artifact, the same student a fit here would have trained."""
    import functools

    from serving.target import tiny_target

    cfg = LoopConfig(drafter="standalone", train=False, k=3, max_tokens=10, day0_init="selfspec",
                     draft_vocab_size=128, selfspec_exit_layer=1)
    loop = _served_loop(target, cfg)
    pre = loop.served[: loop.snapshot_at]
    loader = functools.partial(tiny_target, vocab_size=V, hidden_size=64, num_layers=4, seed=0)
    fits = StaticFits(tmp_path / "bg")
    fits.start(cfg, pre, 4, loader, target.fingerprint, nice=0)
    drafter, fit = static_drafter(target, loop, cfg, steps=4, fits=fits)
    assert fit["background"] is True and fit["traces"] == 6 and fit["train_steps"] >= 1
    assert drafter.inner.kind == "selfspec" and drafter.inner.version == "static"
    _, inline = static_drafter(target, loop, cfg, steps=4, fits=StaticFits(tmp_path / "here"))
    assert "background" not in inline and inline["best_step"] == fit["best_step"]
    # the second kind of the same recipe reuses the background fit
    _, again = static_drafter(target, loop, LoopConfig(**{**cfg.__dict__, "drafter": "hybrid"}), steps=4, fits=fits)
    assert again["reused"] is True


def test_a_background_fit_that_fails_is_done_here_and_unasked_ones_are_stopped(target, tmp_path):
    import functools

    from serving.target import tiny_target

    cfg = LoopConfig(drafter="standalone", train=False, k=3, max_tokens=10, day0_init="selfspec",
                     draft_vocab_size=128, selfspec_exit_layer=1)
    loop = _served_loop(target, cfg)
    pre = loop.served[: loop.snapshot_at]
    other = functools.partial(tiny_target, vocab_size=V + 1, hidden_size=64, num_layers=4, seed=0)
    fits = StaticFits(tmp_path)
    fits.start(cfg, pre, 4, other, target.fingerprint, nice=0)  # not this target: refused there
    _, fit = static_drafter(target, loop, cfg, steps=4, fits=fits)
    assert "background" not in fit and fit["train_steps"] >= 1
    fits.start(cfg, pre, 5, other, target.fingerprint, nice=0)
    (_, proc, _), = fits._pending.values()
    fits.close()
    assert not proc.is_alive() and not fits._pending


def test_the_suffix_kind_goes_first_to_leave_the_learned_kinds_a_core_for_their_static_fit():
    assert kind_order(("hybrid", "suffix", "standalone")) == ["suffix", "hybrid", "standalone"]
    assert kind_order(("standalone", "hybrid")) == ["standalone", "hybrid"]


@pytest.mark.parametrize("kind", ["suffix", "standalone"])
def test_the_static_drafter_serves_each_post_shift_request_beside_the_adapted_one(kind, target):
    """``static_vs_adapted_after_shift`` compares requests served one right after the other (the
    machine's drift weighs on both), not a replay after the stream; the loop's own drafter frozen
    at the shift serves beside the live one, which keeps learning, and both stay lossless."""
    cfg = LoopConfig(drafter=kind, train=False, k=3, max_tokens=10, day0_init="selfspec", draft_vocab_size=128,
                     selfspec_exit_layer=1)
    items = stream(5, "chat", 2) + stream(4, "code", 3)

    async def run():
        base = await target_only_loop(target, items, cfg.max_tokens)
        try:
            return (*await adapted_and_frozen(target, None, items, cfg, static="snapshot", paired=base), base)
        finally:
            await base.stop()

    loop, frozen, base = asyncio.run(run())
    assert [p.domain for p in frozen] == ["code"] * 4 and not any(p.failed for p in frozen)
    assert [p.output for p in frozen] == [p.output for p in base.points[5:]] == [p.output for p in loop.points[5:]]
    assert len(base.points) == len(loop.points) == 9
    # every post-shift position: its three requests finished one after the other, the loop's first
    # on even positions and last on odd ones
    done = sorted([(p.done_at, "loop", p.index) for p in loop.points[5:]]
                  + [(p.done_at, "base", i + 5) for i, p in enumerate(base.points[5:])]
                  + [(p.done_at, "static", i + 5) for i, p in enumerate(frozen)])
    for n, position in enumerate(range(5, 9)):
        group = done[3 * n: 3 * n + 3]
        assert {g[2] for g in group} == {position}
        assert [g[1] for g in group] == (["loop", "base", "static"] if position % 2 == 0
                                         else ["static", "base", "loop"])
