"""thin_linear: ``x @ w.T`` for a few tokens (fp32, CPU) at about the cost of one pass over ``w``.

The CPU kernel is ``kernels/native/thin_linear.c`` (why it exists: see its header), built and
loaded by ``kernels.native_build``. Where it cannot be built, or the inputs are not what it takes
(not fp32, not on the CPU, needing gradients, more than ``MAX_TOKENS`` tokens), ``thin_linear``
answers with the torch reference ``F.linear``: same contract, only slower.

``w`` may also be bf16 with ``x`` fp32: the kernel widens each weight to fp32 in registers and sums
in fp32, reading half the bytes; the reference is ``F.linear(x, w.float())``. Learned drafters
serve their projections this way (a draft's numerics change acceptance, never the output).
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from kernels import native_build, threads

MAX_TOKENS = 32
"""Above this many tokens BLAS's gemm is the better path (measured: ARCHITECTURE.md, "Decode
path"); thin_linear hands over to F.linear."""


def _declare(lib: ctypes.CDLL) -> None:
    lib.thin_linear.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3 + [ctypes.c_int]
    lib.thin_linear.restype = ctypes.c_int
    lib.thin_linear_bf16.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3 + [ctypes.c_int]
    lib.thin_linear_bf16.restype = ctypes.c_int
    lib.thin_linear_vector_width.restype = ctypes.c_int


def _load() -> ctypes.CDLL | None:
    return native_build.load("thin_linear", _declare)


def available() -> bool:
    """Whether the native kernel is built and loaded (builds it on first call)."""
    return _load() is not None


def vector_width() -> int:
    """Floats per vector register the kernel was built for (16 = AVX-512, 8 = AVX2); 0 = none."""
    lib = _load()
    return int(lib.thin_linear_vector_width()) if lib is not None else 0


def _takes(x: torch.Tensor, w: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and w.device.type == "cpu"
        and x.dtype == torch.float32
        and w.dtype in (torch.float32, torch.bfloat16)
        and w.dim() == 2
        and w.is_contiguous()
        and x.shape[-1] == w.shape[1]
        and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
    )


def thin_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` (``F.linear(x, w)``): x [..., K], w [N, K] -> [..., N]."""
    tokens = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not (0 < tokens <= MAX_TOKENS) or not _takes(x, w):
        return _reference(x, w)
    lib = _load()
    if lib is None:
        return _reference(x, w)
    x2 = x.reshape(tokens, x.shape[-1]).contiguous()  # [T, K]
    y = torch.empty(tokens, w.shape[0], dtype=torch.float32, device="cpu")  # [T, N]
    kernel = lib.thin_linear_bf16 if w.dtype == torch.bfloat16 else lib.thin_linear
    rc = kernel(
        x2.data_ptr(), w.data_ptr(), y.data_ptr(), tokens, w.shape[0], w.shape[1],
        threads.kernel_threads(),
    )
    if rc != 0:  # arguments the kernel refused: never silently wrong
        raise RuntimeError(f"thin_linear refused shapes x={tuple(x.shape)} w={tuple(w.shape)}")
    return y.reshape(*x.shape[:-1], w.shape[0])


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.linear, with a bf16 weight beside an fp32 input widened first (the kernel's numerics)."""
    if w.dtype == torch.bfloat16 and x.dtype == torch.float32:
        return F.linear(x, w.float())
    return F.linear(x, w)
