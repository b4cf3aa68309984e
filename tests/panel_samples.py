"""Packed weights and a clean timed kernel setting for the FMA kernel's tests: tests import it as
``panel_samples``."""

import torch

from kernels.packed_linear import PackedLinear


def packed_weights(kind: str, n: int, k: int, g: torch.Generator) -> PackedLinear:
    """An [n, k] weight packed as ``kind`` panels: bf16 (bf16-exact values), fp32 or int8."""
    w = torch.randn(n, k, generator=g) * 0.05
    if kind == "int8":
        return PackedLinear.pack_int8(w)
    if kind == "bf16":
        return PackedLinear.pack(w.bfloat16().float())
    return PackedLinear.pack(w, bf16=False)


def undecided(choice, monkeypatch):
    """Fixture body: the TimedChoice ``choice`` starts undecided, with its environment variable
    unset, and the process's value is as it was afterwards."""
    before, decided = choice.read(), choice.decided
    choice.forget()
    monkeypatch.delenv(choice.env, raising=False)
    yield
    choice.decided = decided
    if before is not None:
        choice.set(before)
