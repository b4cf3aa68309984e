"""A kernel setting timed once per process: values that give the same bits at speeds that depend
on the machine (kernels/group_layout.py, kernels/stream_hint.py).

``TimedChoice.tune(weight)`` times a served weight (a PackedLinear on the FMA panels, e.g. the
target's lm_head) under each value, alternating for a few rounds, and keeps the fastest by the
minimum of its rounds; an environment variable fixes the value without timing. Decided once: later
calls return the first result.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import torch

from kernels import packed_linear
from kernels.packed_linear import PackedLinear

MIN_TUNING_BYTES = 8 << 20
"""A weight smaller than this (a tiny test model's) would time caches, not the machine's memory
and FMA units: it is not timed, and the default stays until a real weight is."""


def native_flag(getter: str, setter: str, on: str, off: str):
    """(read, write) for a TimedChoice kept as an int flag of the packed_linear library: ``on``
    where ``getter()`` is non-zero, else ``off`` (None where the kernel is not built)."""

    def read() -> str | None:
        lib = packed_linear._load()
        return None if lib is None else on if getattr(lib, getter)() else off

    def write(value: str) -> None:
        lib = packed_linear._load()
        if lib is not None:
            getattr(lib, setter)(int(value == on))

    return read, write


class TimedChoice:
    def __init__(self, key: str, env: str, values: tuple[str, ...], read: Callable[[], str | None],
                 write: Callable[[str], None], tokens: int, rounds: int):
        """``key``: the result's name for the value ("layout"); ``read()`` the value in force (None
        where the kernel is not built); ``write(value)`` sets it for every later call."""
        self.key, self.env, self.values = key, env, values
        self.read, self._write = read, write
        self.tokens, self.rounds = tokens, rounds
        self._lock = threading.Lock()
        self.decided: dict | None = None
        """The first decision ({key, "<value>_ms" each, "source"}), or None before one."""

    def set(self, value: str) -> None:
        if value not in self.values:
            raise ValueError(f"{self.key} must be one of {self.values}, got {value!r}")
        self._write(value)

    def forget(self) -> None:
        """Undecided again (tests)."""
        with self._lock:
            self.decided = None

    def tune(self, weight, tokens: int | None = None, rounds: int | None = None) -> dict | None:
        """Time ``weight`` on ``tokens`` tokens under each value and keep the fastest; ``$env``
        set to one of the values sets it instead (a bad value raises: a typo must not silently
        time). Returns the decision, or None where nothing was decided (no kernel, tiles, or a
        weight too small to time)."""
        with self._lock:
            if self.decided is not None:
                return self.decided
            fixed = os.environ.get(self.env, "auto")
            if fixed != "auto":
                self.set(fixed)
                self.decided = {self.key: fixed, **{f"{v}_ms": None for v in self.values}, "source": self.env}
                return self.decided
            if isinstance(weight, PackedLinear):
                weight = weight.exact()  # the FMA kernel's settings: time the FMA kernel
            if (not isinstance(weight, PackedLinear) or weight.layout not in ("fp32", "bf16", "int8")
                    or weight.nbytes < MIN_TUNING_BYTES or self.read() is None):
                return None
            n = tokens or self.tokens
            x = torch.randn(n, weight.in_features, generator=torch.Generator().manual_seed(0))
            best = {v: float("inf") for v in self.values}
            with torch.inference_mode():
                for _ in range(rounds or self.rounds):
                    for v in self.values:
                        self._write(v)
                        t0 = time.perf_counter()
                        weight(x)
                        best[v] = min(best[v], (time.perf_counter() - t0) * 1e3)
            value = min(self.values, key=best.__getitem__)
            self._write(value)
            self.decided = {self.key: value, **{f"{v}_ms": round(best[v], 3) for v in self.values},
                            "source": "timed"}
            return self.decided
