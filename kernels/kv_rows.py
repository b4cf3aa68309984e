"""move_rows: rows of several same-shaped buffers copied to other rows, all read before any is
written, in one native call (``kernels/native/kv_rows.c``; why: see its header). A tree verify's
cache commit moves the accepted path's keys and values this way in every layer. The torch
reference (an index_select and an index_copy_ per buffer) is the path off the CPU, for buffers of
mixed dtypes, or where the kernel does not build.
"""

from __future__ import annotations

import ctypes

import torch

from kernels.native_build import load as load_native


def _declare(lib: ctypes.CDLL) -> None:
    lib.kv_move_rows.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p,
                                 ctypes.c_void_p, ctypes.c_long, ctypes.c_long]
    lib.kv_move_rows.restype = ctypes.c_int


def native_lib() -> ctypes.CDLL | None:
    return load_native("kv_rows", _declare)


def move_rows(buffers: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
    """In each buffer (contiguous, all of one shape [..., D]) seen as [rows, D]: row ``dst[i]`` takes
    what row ``src[i]`` held before the call (``src``, ``dst`` [n] int64 row indices)."""
    if not buffers:
        return
    first = buffers[0]
    d = first.shape[-1]
    native = all(b.device.type == "cpu" and b.dtype == first.dtype and b.is_contiguous()
                 and b.shape == first.shape for b in buffers)
    lib = native_lib() if native else None
    if lib is None:
        src, dst = src.to(first.device), dst.to(first.device)
        for buf in buffers:
            flat = buf.view(-1, d)  # [rows, D]
            flat.index_copy_(0, dst, flat.index_select(0, src))  # a gather first: no aliasing
        return
    src = src.to(torch.long).contiguous()
    dst = dst.to(torch.long).contiguous()
    ptrs = (ctypes.c_void_p * len(buffers))(*[b.data_ptr() for b in buffers])
    rc = lib.kv_move_rows(ptrs, len(buffers), first.numel() // d, src.data_ptr(), dst.data_ptr(),
                          src.shape[0], d * first.element_size())
    if rc != 0:
        raise ValueError(f"move_rows: a row index outside [0, {first.numel() // d})")
