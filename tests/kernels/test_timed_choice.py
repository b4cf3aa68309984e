"""Kernel settings timed once per process (kernels/timed_choice.py), for each one the kernel has:
the token-group layout (kernels/group_layout.py: groups sharing a panel's chunks or making a pass
each) and the prefetch hint for panels streamed once (kernels/stream_hint.py: into L2 or
non-temporal). Every value gives the same bits; a process uses the one it timed faster, or the one
the environment names, decided once."""

from contextlib import contextmanager

import pytest
import torch

from kernels import group_layout as gl
from kernels import packed_linear as pl
from kernels import stream_hint as sh
from kernels.packed_linear import PackedLinear
from kernels.timed_choice import MIN_TUNING_BYTES

needs_native = pytest.mark.skipif(not pl.available(), reason="native kernel not built")


def packed_weights(kind: str, n: int, k: int, g: torch.Generator) -> PackedLinear:
    """An [n, k] weight packed as ``kind`` panels: bf16 (bf16-exact values), fp32 or int8."""
    w = torch.randn(n, k, generator=g) * 0.05
    if kind == "int8":
        return PackedLinear.pack_int8(w)
    if kind == "bf16":
        return PackedLinear.pack(w.bfloat16().float())
    return PackedLinear.pack(w, bf16=False)


@contextmanager
def undecided(choice, monkeypatch):
    """The TimedChoice ``choice`` undecided, its environment variable unset; the process's value
    as it was afterwards."""
    before, decided = choice.read(), choice.decided
    choice.forget()
    monkeypatch.delenv(choice.env, raising=False)
    yield
    choice.decided = decided
    if before is not None:
        choice.set(before)


TUNERS = {"group_layout": (gl.CHOICE, gl.tune_group_layout), "stream_hint": (sh.CHOICE, sh.tune_stream_hint)}


@pytest.fixture(params=sorted(TUNERS))
def tuner(request, monkeypatch):
    """(the TimedChoice, its module's tune function), undecided for the test."""
    choice, tune = TUNERS[request.param]
    with undecided(choice, monkeypatch):
        yield choice, tune


@needs_native
@pytest.mark.parametrize("kind", ["bf16", "fp32", "int8"])
@pytest.mark.parametrize("tokens", [1, 2, 5, 9, 10, 12, 16, 19, 70, 80])
def test_every_value_gives_the_same_bits(tuner, kind, tokens):
    """Layouts and prefetch hints move no result: every output is one FMA chain over k either
    way. With every prologue and a residual, one token group (<= 9 tokens with AVX-512, <= 3 with
    AVX2) and several, a call gives the same bits under each value, and as each token alone."""
    choice, _ = tuner
    g = torch.Generator().manual_seed(tokens + len(kind))
    packed = packed_weights(kind, 577, 584, g)
    assert packed.layout == kind
    x = torch.randn(tokens, 2 * 584, generator=g)
    res = torch.randn(tokens, 577, generator=g)
    norm = torch.rand(584, generator=g) + 0.5

    def calls():
        return [packed(x[:, :584]), packed(x[:, :584], residual=res),
                packed.normed(x[:, :584], norm, 1e-5), packed.swiglu(x, residual=res)]

    results = []
    for value in choice.values:
        choice.set(value)
        assert choice.read() == value
        results.append(calls())
    alone = torch.cat([packed(x[i : i + 1, :584]) for i in range(tokens)])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)
    assert torch.equal(results[0][0], alone)


@needs_native
def test_tuning_keeps_the_value_it_timed_faster_once_per_process(tuner):
    choice, tune = tuner
    head = packed_weights("bf16", 8192, 576, torch.Generator().manual_seed(0))  # 9.4 MB of panels
    assert head.nbytes >= MIN_TUNING_BYTES
    result = tune(head, rounds=2)
    assert result["source"] == "timed" and result[choice.key] in choice.values
    assert all(result[f"{v}_ms"] > 0 for v in choice.values)
    faster = min(choice.values, key=lambda v: result[f"{v}_ms"])
    assert result[choice.key] == faster == choice.read()
    other = next(v for v in choice.values if v != faster)
    choice.set(other)
    assert tune(head) is result  # decided once: no second timing
    assert choice.read() == other


@needs_native
def test_the_environment_fixes_the_value_without_timing(tuner, monkeypatch):
    choice, tune = tuner
    tiny = packed_weights("bf16", 8, 16, torch.Generator().manual_seed(1))
    for value in choice.values:
        choice.forget()
        monkeypatch.setenv(choice.env, value)
        assert tune(tiny) == {choice.key: value, **{f"{v}_ms": None for v in choice.values}, "source": choice.env}
        assert choice.read() == value


@needs_native
def test_a_bad_value_is_refused(tuner, monkeypatch):
    choice, tune = tuner
    with pytest.raises(ValueError, match=choice.values[0]):
        choice.set("fast")
    monkeypatch.setenv(choice.env, "fast")
    with pytest.raises(ValueError, match=choice.values[0]):
        tune(None)


@needs_native
def test_what_cannot_be_timed_leaves_the_default(tuner):
    choice, tune = tuner
    before = choice.read()
    small = packed_weights("bf16", 64, 64, torch.Generator().manual_seed(2))
    assert tune(small) is None  # a tiny model's weight times caches
    assert tune(torch.randn(64, 64)) is None  # not packed
    assert choice.read() == before and choice.decided is None
