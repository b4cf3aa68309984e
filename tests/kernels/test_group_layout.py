"""Token groups in passes or in shared chunks (kernels/group_layout.py): the same bits either way,
and the layout a process uses is the one it timed faster (or the one the environment names)."""

import pytest
import torch
from panel_samples import packed_weights, undecided

from kernels import group_layout as gl
from kernels import packed_linear as pl

needs_native = pytest.mark.skipif(not pl.available(), reason="native kernel not built")


@pytest.fixture(autouse=True)
def _restore_layout(monkeypatch):
    """Each test starts undecided and leaves the process's setting as it found it."""
    yield from undecided(gl.CHOICE, monkeypatch)


@needs_native
@pytest.mark.parametrize("kind", ["bf16", "fp32", "int8"])
@pytest.mark.parametrize("tokens", [4, 10, 16, 19, 70, 80])
def test_passes_and_chunks_give_the_same_bits(kind, tokens):
    """Every output is one FMA chain over k in both layouts: a call gives the bits of the same
    call in the other layout, and of each token alone, with every prologue and a residual."""
    g = torch.Generator().manual_seed(tokens + len(kind))
    packed = packed_weights(kind, 577, 584, g)
    assert packed.layout == kind
    x = torch.randn(tokens, 2 * 584, generator=g)
    res = torch.randn(tokens, 577, generator=g)
    norm = torch.rand(584, generator=g) + 0.5

    def calls():
        return [packed(x[:, :584]), packed(x[:, :584], residual=res),
                packed.normed(x[:, :584], norm, 1e-5), packed.swiglu(x, residual=res)]

    gl.set_group_layout("passes")
    assert gl.group_layout() == "passes"
    passes = calls()
    alone = torch.cat([packed(x[i : i + 1, :584]) for i in range(tokens)])
    gl.set_group_layout("chunks")
    assert gl.group_layout() == "chunks"
    chunks = calls()
    for a, b in zip(passes, chunks):
        assert torch.equal(a, b)
    assert torch.equal(passes[0], alone)


@needs_native
def test_tuning_keeps_the_layout_it_timed_faster_once_per_process():
    g = torch.Generator().manual_seed(0)
    head = packed_weights("bf16", 8192, 576, g)  # 9.4 MB of panels: beyond the caches
    assert head.nbytes >= gl.MIN_TUNING_BYTES
    result = gl.tune_group_layout(head, rounds=2)
    assert result["source"] == "timed" and result["layout"] in gl.LAYOUTS
    faster = min(gl.LAYOUTS, key=lambda layout: result[f"{layout}_ms"])
    assert result["layout"] == faster == gl.group_layout()
    assert result["passes_ms"] > 0 and result["chunks_ms"] > 0
    other = "chunks" if faster == "passes" else "passes"
    gl.set_group_layout(other)
    assert gl.tune_group_layout(head) is result  # decided once: no second timing
    assert gl.group_layout() == other


@needs_native
@pytest.mark.parametrize("layout", gl.LAYOUTS)
def test_the_environment_fixes_the_layout_without_timing(monkeypatch, layout):
    monkeypatch.setenv(gl.ENV, layout)
    tiny = packed_weights("bf16", 8, 16, torch.Generator().manual_seed(1))
    result = gl.tune_group_layout(tiny)
    assert result == {"layout": layout, "passes_ms": None, "chunks_ms": None, "source": gl.ENV}
    assert gl.group_layout() == layout


@needs_native
def test_a_bad_layout_is_refused(monkeypatch):
    with pytest.raises(ValueError, match="passes"):
        gl.set_group_layout("rows")
    monkeypatch.setenv(gl.ENV, "fast")
    with pytest.raises(ValueError, match="passes"):
        gl.tune_group_layout(None)


@needs_native
def test_what_cannot_be_timed_leaves_the_default():
    before = gl.group_layout()
    small = packed_weights("bf16", 64, 64, torch.Generator().manual_seed(2))
    assert gl.tune_group_layout(small) is None  # a tiny model's weight times caches
    assert gl.tune_group_layout(torch.randn(64, 64)) is None  # not packed
    assert gl.group_layout() == before and gl.CHOICE.decided is None
