"""decode_attention: rotary + KV-cache write + masked grouped-query attention for a few new tokens
per row, in one native call per layer (``kernels/native/decode_attention.c``; why: see its header).

The caller owns the cache: ``keys`` and ``values`` are its whole buffers [B, Hkv, C, D] (fp32;
bf16 for a forward on bf16 operands, ``bf16=True``, whose tiles round what they read to bf16
anyway: the keys and values are then rounded once, when written), ``cols`` [B, T] the column each
new token goes to, ``mask`` [B, T, L] which of columns [0, L) each query
sees. The kernel writes the rotated keys and the values at ``cols`` and returns the attention
output [B, T, Hq * D], ready for the output projection. ``takes`` says whether the inputs are what
the kernel computes on (fp32, CPU, contiguous); elsewhere callers keep their torch path.
"""

from __future__ import annotations

import ctypes

import torch

from kernels import native_build, threads


def _declare(lib: ctypes.CDLL) -> None:
    lib.decode_attention.argtypes = (
        [ctypes.c_void_p] * 9 + [ctypes.c_long] * 8 + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
    )
    lib.decode_attention.restype = ctypes.c_int
    lib.decode_attention_bf16_takes.argtypes = [ctypes.c_long] * 3
    lib.decode_attention_bf16_takes.restype = ctypes.c_int


def _load() -> ctypes.CDLL | None:
    return native_build.load("decode_attention", _declare)


def available() -> bool:
    """Whether the native kernel is built and loaded (builds it on first call)."""
    return _load() is not None


def bf16_takes(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether ``decode_attention(..., bf16=True)`` runs for heads of this shape here: the build
    has AVX-512 BF16 and the tiles take the head size (64 or 128) and group (up to 8 query heads
    a kv head)."""
    lib = _load()
    return lib is not None and bool(lib.decode_attention_bf16_takes(num_heads, num_kv_heads, head_dim))


OPERANDS_BF16, KV_BF16 = 1, 2
"""The native call's ``bf16`` bits (decode_attention.c)."""


def cache_dtype_takes(dtype: torch.dtype, bf16: bool) -> bool:
    """Whether the kernel computes on a cache of ``dtype``: fp32, or bf16 where the operands are
    (``bf16``)."""
    return dtype == torch.float32 or (bf16 and dtype == torch.bfloat16)


def cache_takes(keys: torch.Tensor, values: torch.Tensor, bf16: bool) -> bool:
    """Cache buffers the kernel computes on: of a dtype ``cache_dtype_takes``, on the CPU,
    contiguous, the two of one dtype."""
    return (keys.dtype == values.dtype and cache_dtype_takes(keys.dtype, bf16)
            and all(t.device.type == "cpu" and t.is_contiguous() for t in (keys, values)))


def bf16_bits(bf16: bool, keys: torch.Tensor) -> int:
    """The native call's ``bf16`` argument for these operands and this cache."""
    return (OPERANDS_BF16 if bf16 else 0) | (KV_BF16 if keys.dtype == torch.bfloat16 else 0)


def takes(*tensors: torch.Tensor) -> bool:
    """fp32 (or the int64/bool index tensors) on the CPU, contiguous, no gradients wanted."""
    return all(
        t.device.type == "cpu"
        and t.is_contiguous()
        and t.dtype in (torch.float32, torch.int64, torch.bool)
        and not (torch.is_grad_enabled() and t.requires_grad)
        for t in tensors
    )


def decode_attention(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    cols: torch.Tensor,
    mask: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    scale: float,
    rows: torch.Tensor | None = None,
    bf16: bool = False,
) -> torch.Tensor:
    """qkv [B, T, (Hq + 2 Hkv) D]; cos, sin [B, T, D]; keys, values [Bc, Hkv, C, D] (fp32, or
    bf16 with ``bf16``; written at ``cols`` [B, T]); mask [B, T, L] bool; ``rows`` [B] int64: the
    cache row of each row (None: the same row, Bc = B). ``bf16``: scores and the weighted sum on
    bf16 operands, fp32 accumulation (native/attention_tiles_bf16.h; where ``bf16_takes``), for a
    forward on bf16 activations. Returns the attention output [B, T, Hq * D]."""
    lib = _load()
    if lib is None:
        raise RuntimeError("decode_attention: native kernel not available (check available())")
    b, t, width = qkv.shape
    _, hkv, capacity, d = keys.shape
    length = mask.shape[-1]
    if width != (num_heads + 2 * num_kv_heads) * d or hkv != num_kv_heads:
        raise ValueError(f"qkv width {width} does not fit {num_heads}+2x{num_kv_heads} heads of {d}")
    if cos.shape != (b, t, d) or sin.shape != (b, t, d) or values.shape != keys.shape:
        raise ValueError("cos/sin must be [B, T, D] and values shaped as keys")
    if cols.shape != (b, t) or mask.shape != (b, t, length):
        raise ValueError("cols must be [B, T] and mask [B, T, L] for the same rows")
    if rows is None and keys.shape[0] != b:
        raise ValueError(f"{b} rows of queries for a cache of {keys.shape[0]} rows (pass rows=)")
    if rows is not None and (rows.shape != (b,) or rows.dtype != torch.int64 or not takes(rows)):
        raise ValueError("rows must be [B] contiguous int64 on the CPU")
    if not takes(qkv, cos, sin, cols, mask) or cols.dtype != torch.int64 or not cache_takes(keys, values, bf16):
        raise ValueError("decode_attention takes contiguous fp32 CPU tensors (int64 cols, bool mask; "
                         "a bf16 cache with bf16=True)")
    out = torch.empty(b, t, num_heads * d, dtype=torch.float32, device="cpu")  # [B, T, Hq * D]
    rc = lib.decode_attention(
        qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), keys.data_ptr(), values.data_ptr(),
        cols.data_ptr(), rows.data_ptr() if rows is not None else None, mask.data_ptr(),
        out.data_ptr(), b, keys.shape[0], t, num_heads, num_kv_heads, d, capacity, length, scale,
        threads.kernel_threads(), bf16_bits(bf16, keys),
    )
    if rc != 0:  # a column outside [0, L), a row outside the cache, or L > capacity: refused
        raise ValueError(
            f"decode_attention refused: cols outside [0, {length}), rows outside the cache's "
            f"{keys.shape[0]}, L > capacity {capacity}, or bf16 where bf16_takes is False"
        )
    return out
