"""How the FMA kernel prefetches a panel it streams once, chosen by timing both on this machine.

A call of at most RMAX tokens (a decode step, a verify of up to 9 tokens with AVX-512, 6 with
AVX2) reads each fp32 or bf16 panel once (kernels/native/packed_linear.c, ``stream_nt``). Its rows can be prefetched
into L2 ("l2", prefetcht2, the default) or with the non-temporal hint ("nta", prefetchnta), which
on a 2-core Zen 4 EPYC ran SmolLM2-135M's lm_head ~15 % faster at 1-2 tokens and its forward at
1 / 2 / 4 tokens ~3 / 6 / 5 % faster on two threads, its one-token step 17.8 -> 13.1-14.1 ms on
one, while an early session measured non-temporal prefetches twice as slow on a Xeon. The same bits
either way, so ``tune_stream_hint`` times both on a served weight once per process and keeps the
faster.
"""

from __future__ import annotations

from kernels.timed_choice import TimedChoice, native_flag

HINTS = ("l2", "nta")

ENV = "SPECLOOP_STREAM_HINT"
"""l2 | nta fixes the hint without timing; auto (the default) times both."""

stream_hint, _write = native_flag("packed_linear_stream_nt", "packed_linear_set_stream_nt", "nta", "l2")
"""``stream_hint()``: the hint this process's one-group calls use; None where the kernel is not built."""

CHOICE = TimedChoice("hint", ENV, HINTS, stream_hint, _write, tokens=1, rounds=7)


def set_stream_hint(hint: str) -> None:
    """Use ``hint`` ("l2" or "nta") for every later one-group call in this process."""
    CHOICE.set(hint)


def tune_stream_hint(weight, tokens: int | None = None, rounds: int | None = None) -> dict | None:
    """Time ``weight`` (a served PackedLinear, e.g. the target's lm_head) on ``tokens`` tokens
    (default: ``CHOICE``'s 1) under each hint, alternating for ``rounds`` rounds (``CHOICE``'s 7), and
    keep the faster. Once per process; ``$ENV`` fixes it. Returns {"hint", "l2_ms", "nta_ms",
    "source"}, or None where nothing was decided."""
    return CHOICE.tune(weight, tokens, rounds)
