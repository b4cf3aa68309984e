"""argmax_rows: the argmax of chosen rows of a [R, V] matrix, as a greedy verify reads the target's
logits at the positions it verified (``kernels/native/argmax_rows.c``; why: see its header).
Same answers as ``x[rows].argmax(-1)`` (the first maximum); that is also the path off the CPU, for
other dtypes, or where the kernel does not build.
"""

from __future__ import annotations

import ctypes

import torch

from kernels.native_build import load as load_native
from kernels.threads import kernel_threads


def _declare(lib: ctypes.CDLL) -> None:
    lib.argmax_rows.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3 + [ctypes.c_int]
    lib.argmax_rows.restype = ctypes.c_int
    lib.tree_walk.argtypes = [ctypes.c_void_p] * 9 + [ctypes.c_long] * 4 + [ctypes.c_int]
    lib.tree_walk.restype = ctypes.c_int


def native_lib() -> ctypes.CDLL | None:
    """``native/argmax_rows.c`` loaded (``argmax_rows`` and the verify's ``tree_walk``,
    kernels/tree_verify.py), or None where it does not build."""
    return load_native("argmax_rows", _declare)


def argmax_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x [R, V], rows [n] int64 -> [n] int64: the argmax of each chosen row."""
    native = x.device.type == "cpu" and x.dtype == torch.float32 and x.is_contiguous()
    lib = native_lib() if native else None
    if lib is None:
        return x.index_select(0, rows.to(x.device)).argmax(-1)
    rows = rows.to(torch.long).contiguous()
    out = torch.empty(rows.shape[0], dtype=torch.long, device="cpu")
    # a worker takes whole rows: for one or two rows (batch 1) waking one costs more than it saves
    threads = min(kernel_threads(), rows.shape[0] // 2) or 1
    rc = lib.argmax_rows(x.data_ptr(), rows.data_ptr(), out.data_ptr(), rows.shape[0], x.shape[0],
                         x.shape[1], threads)
    if rc != 0:
        raise ValueError(f"argmax_rows refused rows outside [0, {x.shape[0]})")
    return out
