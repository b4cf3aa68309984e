"""Panels streamed once, prefetched into L2 or non-temporally (kernels/stream_hint.py): the same
bits either way, and the hint a process uses is the one it timed faster (or the one the environment
names)."""

import pytest
import torch
from panel_samples import packed_weights, undecided

from kernels import packed_linear as pl
from kernels import stream_hint as sh
from kernels.timed_choice import MIN_TUNING_BYTES

needs_native = pytest.mark.skipif(not pl.available(), reason="native kernel not built")


@pytest.fixture(autouse=True)
def _restore_hint(monkeypatch):
    """Each test starts undecided and leaves the process's setting as it found it."""
    yield from undecided(sh.CHOICE, monkeypatch)


@needs_native
@pytest.mark.parametrize("kind", ["bf16", "fp32", "int8"])
@pytest.mark.parametrize("tokens", [1, 2, 5, 9, 12])
def test_both_hints_give_the_same_bits(kind, tokens):
    """A prefetch moves no result: every prologue and a residual, one group (<= 9 tokens with
    AVX-512, <= 3 with AVX2) and several, give the same bits under both hints, and as each token
    alone."""
    g = torch.Generator().manual_seed(tokens + len(kind))
    packed = packed_weights(kind, 577, 584, g)
    x = torch.randn(tokens, 2 * 584, generator=g)
    res = torch.randn(tokens, 577, generator=g)
    norm = torch.rand(584, generator=g) + 0.5

    def calls():
        return [packed(x[:, :584]), packed(x[:, :584], residual=res),
                packed.normed(x[:, :584], norm, 1e-5), packed.swiglu(x, residual=res)]

    sh.set_stream_hint("nta")
    assert sh.stream_hint() == "nta"
    nta = calls()
    alone = torch.cat([packed(x[i : i + 1, :584]) for i in range(tokens)])
    sh.set_stream_hint("l2")
    assert sh.stream_hint() == "l2"
    l2 = calls()
    for a, b in zip(nta, l2):
        assert torch.equal(a, b)
    assert torch.equal(nta[0], alone)


@needs_native
def test_tuning_keeps_the_hint_it_timed_faster_once_per_process():
    head = packed_weights("bf16", 8192, 576, torch.Generator().manual_seed(0))  # 9.4 MB of panels
    assert head.nbytes >= MIN_TUNING_BYTES
    result = sh.tune_stream_hint(head, rounds=2)
    assert result["source"] == "timed" and result["hint"] in sh.HINTS
    faster = min(sh.HINTS, key=lambda hint: result[f"{hint}_ms"])
    assert result["hint"] == faster == sh.stream_hint()
    assert result["l2_ms"] > 0 and result["nta_ms"] > 0
    other = "l2" if faster == "nta" else "nta"
    sh.set_stream_hint(other)
    assert sh.tune_stream_hint(head) is result  # decided once: no second timing
    assert sh.stream_hint() == other


@needs_native
@pytest.mark.parametrize("hint", sh.HINTS)
def test_the_environment_fixes_the_hint_without_timing(monkeypatch, hint):
    monkeypatch.setenv(sh.ENV, hint)
    tiny = packed_weights("bf16", 8, 16, torch.Generator().manual_seed(1))
    assert sh.tune_stream_hint(tiny) == {"hint": hint, "l2_ms": None, "nta_ms": None, "source": sh.ENV}
    assert sh.stream_hint() == hint


@needs_native
def test_a_bad_hint_is_refused(monkeypatch):
    with pytest.raises(ValueError, match="nta"):
        sh.set_stream_hint("t0")
    monkeypatch.setenv(sh.ENV, "fast")
    with pytest.raises(ValueError, match="nta"):
        sh.tune_stream_hint(None)


@needs_native
def test_what_cannot_be_timed_leaves_the_default():
    before = sh.stream_hint()
    small = packed_weights("bf16", 64, 64, torch.Generator().manual_seed(2))
    assert sh.tune_stream_hint(small) is None  # a tiny model's weight times caches
    assert sh.tune_stream_hint(torch.randn(64, 64)) is None  # not packed
    assert sh.stream_hint() == before and sh.CHOICE.decided is None
