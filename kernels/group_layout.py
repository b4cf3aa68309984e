"""How groups of tokens share a panel's stream in the FMA kernel, chosen by timing both on this machine.

A forward of more than RMAX tokens (9 with AVX-512, 6 with AVX2) splits them into groups
(kernels/native/packed_linear.c). Either the groups share each chunk of a panel as it streams in
("chunks"), or each group makes its own pass over the panel, the later ones from L2 ("passes").
Both compute each output in one FMA chain over k, so the results are the same bits; only the speed
differs, and which is faster has depended on the machine and the build: on a 2-core Zen 4 EPYC
(AVX-512) passes took a 16-token verify of SmolLM2-135M from 3.4 to 2.8 one-token steps, while an
AVX2 build with groups of 3 ran 16 tokens' projections 25 % slower in passes there (with groups of
6, on a Zen 3 EPYC with AVX2 only, passes were faster again: 33 against 39 ms). So the build's
default (passes) stands until ``tune_group_layout`` has timed both on a served weight, once per
process.
"""

from __future__ import annotations

from kernels.timed_choice import MIN_TUNING_BYTES, TimedChoice, native_flag

LAYOUTS = ("passes", "chunks")

ENV = "SPECLOOP_GROUP_LAYOUT"
"""passes | chunks fixes the layout without timing; auto (the default) times both."""

__all__ = ["CHOICE", "ENV", "LAYOUTS", "MIN_TUNING_BYTES", "group_layout", "set_group_layout", "tune_group_layout"]

group_layout, _write = native_flag("packed_linear_group_passes", "packed_linear_set_group_passes", "passes", "chunks")
"""``group_layout()``: the layout this process's forwards use; None where the kernel is not built."""

CHOICE = TimedChoice("layout", ENV, LAYOUTS, group_layout, _write, tokens=16, rounds=5)


def set_group_layout(layout: str) -> None:
    """Use ``layout`` ("passes" or "chunks") for every later call in this process."""
    CHOICE.set(layout)


def tune_group_layout(weight, tokens: int | None = None, rounds: int | None = None) -> dict | None:
    """Time ``weight`` (a served PackedLinear on the FMA panels, e.g. the target's lm_head) on
    ``tokens`` tokens (default: ``CHOICE``'s 16) in each layout, alternating for ``rounds`` rounds
    (``CHOICE``'s 5), and keep the faster by the minimum of its rounds. Once per process: later calls
    return the first result. ``$ENV`` = passes | chunks sets that layout instead. Returns {"layout",
    "passes_ms", "chunks_ms", "source"}, or None where nothing was decided (no kernel, tiles, or a
    weight too small)."""
    return CHOICE.tune(weight, tokens, rounds)
