"""How groups of tokens share a panel's stream in the FMA kernel, chosen by timing both on this machine.

A forward of more than RMAX tokens (9 with AVX-512, 3 with AVX2) splits them into groups
(kernels/native/packed_linear.c). Either the groups share each chunk of a panel as it streams in
("chunks"), or each group makes its own pass over the panel, the later ones from L2 ("passes").
Both compute each output in one FMA chain over k, so the results are the same bits; only the speed
differs, and which is faster depends on the machine: on a 2-core Zen 4 EPYC (AVX-512) passes took
a 16-token verify of SmolLM2-135M from 3.4 to 2.8 one-token steps, while the same source built for
AVX2 there ran 16 tokens' projections 25 % slower in passes. So the build's default (passes with
AVX-512) stands until ``tune_group_layout`` has timed both on a served weight, once per process.
"""

from __future__ import annotations

import os
import threading
import time

import torch

from kernels import packed_linear
from kernels.packed_linear import PackedLinear

LAYOUTS = ("passes", "chunks")

ENV = "SPECLOOP_GROUP_LAYOUT"
"""passes | chunks fixes the layout without timing; auto (the default) times both."""

MIN_TUNING_BYTES = 8 << 20
"""A weight smaller than this (a tiny test model's) would time caches, not the machine's memory
and FMA units: it is not timed, and the default stays until a real weight is."""

_lock = threading.Lock()
_tuned: dict | None = None


def group_layout() -> str | None:
    """The layout this process's forwards use; None where the kernel is not built."""
    lib = packed_linear._load()
    if lib is None:
        return None
    return "passes" if lib.packed_linear_group_passes() else "chunks"


def set_group_layout(layout: str) -> None:
    """Use ``layout`` ("passes" or "chunks") for every later call in this process."""
    if layout not in LAYOUTS:
        raise ValueError(f"group layout must be one of {LAYOUTS}, got {layout!r}")
    lib = packed_linear._load()
    if lib is not None:
        lib.packed_linear_set_group_passes(int(layout == "passes"))


def tune_group_layout(weight, tokens: int = 16, rounds: int = 5) -> dict | None:
    """Time ``weight`` (a served PackedLinear on the FMA panels, e.g. the target's lm_head) on
    ``tokens`` tokens in each layout, alternating for ``rounds`` rounds, and keep the faster by the
    minimum of its rounds. Once per process: later calls return the first result. ``$ENV`` =
    passes | chunks sets that layout instead. Returns {"layout", "passes_ms", "chunks_ms",
    "source"}, or None where nothing was decided (no kernel, tiles, or a weight too small)."""
    global _tuned
    with _lock:
        if _tuned is not None:
            return _tuned
        fixed = os.environ.get(ENV, "auto")
        if fixed != "auto":
            set_group_layout(fixed)  # raises on a bad value: a typo must not silently time
            _tuned = {"layout": fixed, "passes_ms": None, "chunks_ms": None, "source": ENV}
            return _tuned
        if (not isinstance(weight, PackedLinear) or weight.layout not in ("fp32", "bf16", "int8")
                or weight.nbytes < MIN_TUNING_BYTES or group_layout() is None):
            return None
        x = torch.randn(tokens, weight.in_features, generator=torch.Generator().manual_seed(0))
        best = {layout: float("inf") for layout in LAYOUTS}
        with torch.inference_mode():
            for _ in range(rounds):
                for layout in LAYOUTS:
                    set_group_layout(layout)
                    t0 = time.perf_counter()
                    weight(x)
                    best[layout] = min(best[layout], (time.perf_counter() - t0) * 1e3)
        layout = min(LAYOUTS, key=best.__getitem__)
        set_group_layout(layout)
        _tuned = {"layout": layout, "passes_ms": round(best["passes"], 3),
                  "chunks_ms": round(best["chunks"], 3), "source": "timed"}
        return _tuned
