"""What this CPU is and which vector extensions it has (read once from /proc/cpuinfo).

Speed ratios on this project's machines depend on them: the same kind of machine has come with
AVX-512 + bf16 dot products (AVX512-BF16, AMX) and with AVX2 only. Kernels pick their path by these
flags, the trainer its training precision, and benchmarks print them beside every figure.
"""

from __future__ import annotations

import functools
import os
import platform

SIMD_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "neon", "sve")
"""The flags that decide which kernels (and training precisions) run fast here."""


@functools.cache
def _cpuinfo() -> tuple[str, str]:
    """(model name, the raw flags line) of the first CPU; empty where /proc/cpuinfo is unreadable."""
    model = flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not model and line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                elif not flags and line.startswith(("flags", "Features")):
                    flags = line.split(":", 1)[1].strip()
                if model and flags:
                    break
    except OSError:
        pass
    return model, flags


def flags_line() -> str:
    """The CPU's whole flags line (a cache key for code compiled for this CPU)."""
    return _cpuinfo()[1]


def cpu_flags() -> frozenset[str]:
    return frozenset(flags_line().split())


def cpu_model() -> str:
    return _cpuinfo()[0] or platform.processor() or platform.machine()


def native_bf16() -> bool:
    """bf16 dot products in hardware (AVX512-BF16 or AMX): where bf16 matmuls beat fp32 ones. On
    AVX2 alone bf16 is converted in software and runs slower than fp32."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def cpu_info() -> dict:
    """The CPU model, its flags among ``SIMD_FLAGS`` and the CPU count (benchmarks' JSON)."""
    flags = cpu_flags()
    return {"model": cpu_model(), "flags": sorted(f for f in SIMD_FLAGS if f in flags), "cpus": os.cpu_count()}
