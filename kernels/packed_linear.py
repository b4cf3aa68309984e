"""PackedLinear: ``x @ w.T`` for any number of tokens (fp32, CPU), with ``w`` repacked once into
panels that the native kernel streams (``kernels/native/packed_linear.c``; why: see its header).

A weight is packed once, when a forward is built (``PackedLinear.pack(w)``), and then called like
``F.linear(x, w)``. Packing copies the weight (same bytes, another layout), so callers pack what
they serve and keep the original for everything else (training, the reference forward).
``pack`` returns None where the kernel cannot be built, or the weight is not a 2-D fp32 CPU
tensor: the caller then keeps its row-major path.

Panels are bf16 where every weight is exactly a bf16 value (``pack(w, bf16=True)``, the default):
the default SmolLM2 target's weights are (they were dequantised to a bf16 cache), so a decode step
streams half the bytes, and since a bf16 weight widened to fp32 is the same number the results are
bit for bit those of fp32 panels. Other weights keep fp32 panels.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from kernels import native_build, threads

_NONE, _RMSNORM, _SWIGLU = 0, 1, 2  # prologues of packed_linear_fused (see the C source)


def _declare(lib: ctypes.CDLL) -> None:
    lib.packed_linear_fused.argtypes = (
        [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_float]
        + [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3 + [ctypes.c_int]
    )
    lib.packed_linear_fused.restype = ctypes.c_int
    lib.packed_linear_fused_bf16.argtypes = lib.packed_linear_fused.argtypes
    lib.packed_linear_fused_bf16.restype = ctypes.c_int
    lib.packed_linear_panel_width.restype = ctypes.c_int


def _load() -> ctypes.CDLL | None:
    return native_build.load("packed_linear", _declare)


def available() -> bool:
    """Whether the native kernel is built and loaded (builds it on first call)."""
    return _load() is not None


def panel_width() -> int:
    """Outputs per panel (48 with AVX-512, 32 otherwise); 0 where the kernel is not available."""
    lib = _load()
    return int(lib.packed_linear_panel_width()) if lib is not None else 0


def bf16_exact(w: torch.Tensor) -> bool:
    """Whether every value of ``w`` (fp32) is exactly a bf16 value (its low 16 bits are zero)."""
    return bool((w.contiguous().view(torch.int32) & 0xFFFF).eq(0).all())


class PackedLinear:
    """A weight ``w`` [N, K] as panels [ceil(N/P), K, P] (zero-padded to whole panels), fp32 or
    bf16 (``panels.dtype``)."""

    def __init__(self, panels: torch.Tensor, out_features: int, lib: ctypes.CDLL):
        self.panels = panels  # [N/P, K, P]
        self.out_features = out_features
        self.in_features = panels.shape[1]
        self._fused = (lib.packed_linear_fused_bf16 if panels.dtype == torch.bfloat16
                       else lib.packed_linear_fused)  # the entry for this panel dtype

    @classmethod
    def pack(cls, w: torch.Tensor, bf16: bool = True) -> PackedLinear | None:
        """Panels of ``w``; bf16 ones when ``bf16`` and every weight is exactly a bf16 value."""
        if w.dim() != 2 or w.dtype != torch.float32 or w.device.type != "cpu":
            return None
        lib = _load()
        if lib is None:
            return None
        p = int(lib.packed_linear_panel_width())
        n, k = w.shape
        count = -(-n // p)
        with torch.no_grad():
            dtype = torch.bfloat16 if bf16 and bf16_exact(w) else torch.float32
            padded = torch.zeros(count * p, k, dtype=dtype)
            padded[:n] = w  # exact either way
            panels = padded.view(count, p, k).transpose(1, 2).contiguous()  # [N/P, K, P]
        return cls(panels, n, lib)

    @property
    def entry(self):
        """The C entry (ctypes function) for these panels' dtype: ``packed_linear_fused`` or
        ``packed_linear_fused_bf16`` (kernels/llama_layers.py calls it from C)."""
        return self._fused

    @property
    def nbytes(self) -> int:
        """Bytes one call reads from the weight (padding included)."""
        return self.panels.numel() * self.panels.element_size()

    def unpacked(self) -> torch.Tensor:
        """The weight as [N, K] again (tests, and the reference path)."""
        n = self.out_features
        return self.panels.transpose(1, 2).reshape(-1, self.in_features)[:n].float()

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear(x, w) (+ residual)``: x [..., K] fp32 -> [..., N]."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input has {x.shape[-1]} features; the weight takes {self.in_features}")
        if not self._native(x, residual):
            return self._reference(x, residual)
        return self._run(x, _NONE, None, 0.0, residual)

    def normed(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``F.linear(rms_norm(x) * weight, w) (+ residual)``: Llama's pre-norm and the projection
        after it in one call (the norm in fp32, as transformers computes it)."""
        if x.shape[-1] != self.in_features or weight.shape != (self.in_features,):
            raise ValueError(f"input and norm weight must have {self.in_features} features")
        if not self._native(x, residual, weight):
            return self._reference(F.rms_norm(x, (self.in_features,), weight, eps), residual)
        return self._run(x, _RMSNORM, weight.contiguous(), eps, residual)

    def swiglu(self, gate_up: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear(silu(gate) * up, w) (+ residual)`` for gate_up = [gate | up] [..., 2K]: a
        Llama MLP's down projection with the activation before it, in one call."""
        if gate_up.shape[-1] != 2 * self.in_features:
            raise ValueError(f"gate_up must have 2 x {self.in_features} features")
        if not self._native(gate_up, residual):
            k = self.in_features
            return self._reference(F.silu(gate_up[..., :k]) * gate_up[..., k:], residual)
        return self._run(gate_up, _SWIGLU, None, 0.0, residual)

    def _reference(self, h: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """The torch path, after the prologue: ``F.linear(h, w) (+ residual)``."""
        y = F.linear(h, self.unpacked())
        return y if residual is None else y + residual

    @staticmethod
    def _native(*tensors: torch.Tensor | None) -> bool:
        return all(
            t is None
            or (
                t.dtype == torch.float32
                and t.device.type == "cpu"
                and not (torch.is_grad_enabled() and t.requires_grad)
            )
            for t in tensors
        )

    def _run(self, x, prologue: int, weight, eps: float, residual) -> torch.Tensor:
        width = x.shape[-1]
        tokens = x.numel() // width if width else 0
        y = torch.empty(*x.shape[:-1], self.out_features, dtype=torch.float32)  # [..., N]
        if tokens == 0:
            return y
        x2 = x.reshape(tokens, width).contiguous()  # [T, K] (or [T, 2K] for swiglu)
        res = None
        if residual is not None:
            if residual.shape != y.shape:
                raise ValueError(f"residual {tuple(residual.shape)} != output {tuple(y.shape)}")
            res = residual.reshape(tokens, self.out_features).contiguous()  # [T, N]
        rc = self._fused(
            x2.data_ptr(), prologue, weight.data_ptr() if weight is not None else None, eps,
            self.panels.data_ptr(), res.data_ptr() if res is not None else None, y.data_ptr(),
            tokens, self.out_features, self.in_features, threads.kernel_threads(),
        )
        if rc != 0:  # arguments the kernel refused: never silently wrong
            raise RuntimeError(f"packed_linear refused x={tuple(x.shape)} w={tuple(self.panels.shape)}")
        return y
