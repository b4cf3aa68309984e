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

A learned drafter's weights can be packed as int8 panels instead (``pack_int8``: one scale per
output, half the bytes of bf16; not exact, so never for the target): a draft token streams its
layers and head from memory, so the bytes are most of its price.

A forward may instead read the bf16 panels with every activation rounded to bf16 (``rounded()``):
on a CPU with AVX-512 BF16 (``dot_available()``) the bf16 dot product then does two multiply-adds
per lane and instruction (kernels/native/packed_linear_dot.c), the same panels, not fp32-exact;
a target served so (``EngineConfig.bf16_activations``) stays lossless against its own target-only
decoding, since every one of its forwards rounds alike.

Where the CPU has AMX-BF16 (``amx_available()``), such weights can instead be packed for tile
multiplies (``pack(w, amx=True)``; kernels/native/packed_linear_amx.c): a forward of up to 16
tokens then costs about what one token does. Its fp32 results are as precise as the FMA panels'
but not bit for bit theirs (the additions run in another order); within one layout a token's
outputs never depend on how many tokens share the call.
"""

from __future__ import annotations

import ctypes
import os

import torch
import torch.nn.functional as F

from kernels import native_build, threads

_NONE, _RMSNORM, _SWIGLU = 0, 1, 2  # prologues of packed_linear_fused (see the C source)


# (x, prologue, norm weight, eps, weights, residual, y, T, N, K, threads): every fused entry's
_FUSED_ARGS = ([ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_float]
               + [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3 + [ctypes.c_int])


def _declare(lib: ctypes.CDLL) -> None:
    for entry in (lib.packed_linear_fused, lib.packed_linear_fused_bf16, lib.packed_linear_fused_int8):
        entry.argtypes, entry.restype = _FUSED_ARGS, ctypes.c_int
    lib.packed_linear_panel_width.restype = ctypes.c_int
    lib.packed_linear_set_group_passes.argtypes = [ctypes.c_int]
    lib.packed_linear_set_group_passes.restype = None
    lib.packed_linear_group_passes.restype = ctypes.c_int
    lib.packed_linear_set_stream_nt.argtypes = [ctypes.c_int]
    lib.packed_linear_set_stream_nt.restype = None
    lib.packed_linear_stream_nt.restype = ctypes.c_int


def _load() -> ctypes.CDLL | None:
    return native_build.load("packed_linear", _declare)


def _declare_amx(lib: ctypes.CDLL) -> None:
    for entry in (lib.packed_linear_fused_amx, lib.packed_linear_fused_amx_bf16a):
        entry.argtypes, entry.restype = _FUSED_ARGS, ctypes.c_int
    lib.packed_linear_amx_init.restype = ctypes.c_int
    lib.packed_linear_amx_panel_width.restype = ctypes.c_int


def _load_amx() -> ctypes.CDLL | None:
    """The AMX kernel where it is built, the CPU has AMX-BF16 and the OS grants the tile state
    (and its panels are the width ``_amx_tiles`` packs); None with ``SPECLOOP_AMX=0`` (the FMA
    kernel then serves every layout)."""
    if os.environ.get("SPECLOOP_AMX", "1") == "0":
        return None
    lib = native_build.load("packed_linear_amx", _declare_amx)
    if lib is None or lib.packed_linear_amx_init() != 0:
        return None
    if lib.packed_linear_amx_panel_width() != _AMX_PANEL:
        raise RuntimeError(f"packed_linear_amx panels are {lib.packed_linear_amx_panel_width()} wide; "
                           f"kernels/packed_linear.py packs {_AMX_PANEL}")
    return lib


def _declare_dot(lib: ctypes.CDLL) -> None:
    lib.packed_linear_fused_bf16dot.argtypes = _FUSED_ARGS
    lib.packed_linear_fused_bf16dot.restype = ctypes.c_int
    lib.packed_linear_dot_available.restype = ctypes.c_int


def _load_dot() -> ctypes.CDLL | None:
    """The bf16 dot-product kernel (kernels/native/packed_linear_dot.c) where it is built and the
    CPU has AVX-512 BF16 (and its panels are the FMA kernel's width); None with
    ``SPECLOOP_BF16_DOT=0``."""
    if os.environ.get("SPECLOOP_BF16_DOT", "1") == "0" or _load() is None:
        return None
    lib = native_build.load("packed_linear_dot", _declare_dot)
    if lib is None or not lib.packed_linear_dot_available():
        return None
    return lib


def dot_available() -> bool:
    """Whether ``PackedLinear.rounded()`` of bf16 panels runs on the CPU's bf16 dot product."""
    return _load_dot() is not None


def rounding_available() -> bool:
    """Whether ``rounded()`` multiplies bf16 activations on this CPU at all (a bf16 dot product or
    AMX tiles); elsewhere a forward asked to round runs exact."""
    return dot_available() or amx_available()


def amx_available() -> bool:
    """Whether ``pack(w, amx=True)`` can pack for AMX tiles on this machine."""
    return _load_amx() is not None


_AMX_PANEL, _AMX_K = 32, 32  # outputs per panel (two 16-wide tiles), k per tile


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


def _amx_tiles(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] (exactly bf16) -> AMX panels [ceil(N/32), K/32, 2, 16, 16, 2] bf16: panel p, k block
    kb, tile s, tile row kp, column nn, pair i = w[32 p + 16 s + nn, 32 kb + 2 kp + i]."""
    n, k = w.shape
    count = -(-n // _AMX_PANEL)
    with torch.no_grad():
        padded = torch.zeros(count * _AMX_PANEL, k, dtype=torch.bfloat16, device="cpu")
        padded[:n] = w
        t = padded.view(count, 2, 16, k // _AMX_K, 16, 2)  # [p, s, nn, kb, kp, i]
        return t.permute(0, 3, 1, 4, 2, 5).contiguous()  # [p, kb, s, kp, nn, i]


def _lib_for(w: torch.Tensor) -> ctypes.CDLL | None:
    """The FMA kernel's library where ``w`` is a 2-D fp32 CPU matrix and the kernel is built."""
    if w.dim() != 2 or w.dtype != torch.float32 or w.device.type != "cpu":
        return None
    return _load()


def _panel_layout(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """w [N, K] -> panels [ceil(N/P), K, P] of ``dtype`` (zero-padded to whole panels); bf16
    ones [ceil(N/P), K/2, P, 2], each pair of rows k, k+1 interleaved (K even; see
    kernels/native/panel_layout.h)."""
    n, k = w.shape
    p = panel_width()
    count = -(-n // p)
    padded = torch.zeros(count * p, k, dtype=dtype, device="cpu")
    padded[:n] = w
    if dtype == torch.bfloat16:
        return padded.view(count, p, k // 2, 2).permute(0, 2, 1, 3).contiguous()  # [N/P, K/2, P, 2]
    return padded.view(count, p, k).transpose(1, 2).contiguous()  # [N/P, K, P]


class PackedLinear:
    """A weight ``w`` [N, K] as panels (zero-padded to whole panels): ``layout`` "fp32",
    [ceil(N/P), K, P]; "bf16", [ceil(N/P), K/2, P, 2] (rows k and k+1 interleaved); "amx",
    [ceil(N/32), K/32, 2, 16, 16, 2] bf16 tiles; or "int8", one byte buffer holding [ceil(N/P), K,
    P] int8 and then ceil(N/P) x P fp32 scales (``pack_int8``). ``rounds_activations``: read with
    bf16 activations (``rounded()``)."""

    def __init__(self, panels: torch.Tensor, out_features: int, in_features: int, layout: str,
                 fused, rounds_activations: bool = False):
        self.panels = panels
        self.out_features = out_features
        self.in_features = in_features
        self.layout = layout
        self._fused = fused  # the C entry for this layout
        self.rounds_activations = rounds_activations
        """Whether each activation is rounded to bf16 before the multiply (``rounded()``)."""

    def rounded(self) -> PackedLinear:
        """This weight (the same panels, no copy) read with each activation, after the prologue,
        rounded to its nearest bf16 value: on AMX tiles one part instead of three exact ones; on
        bf16 panels, where the CPU has AVX-512 BF16, two multiply-adds per lane and instruction
        instead of one (kernels/native/packed_linear_dot.c). Not fp32-exact (relative error up to
        2^-9 per activation), so only for forwards chosen as a whole to run rounded (a drafter's;
        a target's with ``EngineConfig.bf16_activations``): within such a forward a token's result
        does not depend on how many tokens share the call. Itself elsewhere (fp32 or int8 panels,
        no bf16 dot product: the activations stay fp32)."""
        if self.rounds_activations:
            return self
        if self.layout == "amx":
            return PackedLinear(self.panels, self.out_features, self.in_features, self.layout,
                                _load_amx().packed_linear_fused_amx_bf16a, rounds_activations=True)
        if self.layout == "bf16" and (dot := _load_dot()) is not None:
            return PackedLinear(self.panels, self.out_features, self.in_features, self.layout,
                                dot.packed_linear_fused_bf16dot, rounds_activations=True)
        return self

    def exact(self) -> PackedLinear:
        """This weight (the same panels) read with fp32 activations: ``rounded()`` undone."""
        if not self.rounds_activations:
            return self
        lib = _load_amx() if self.layout == "amx" else _load()
        entry = lib.packed_linear_fused_amx if self.layout == "amx" else lib.packed_linear_fused_bf16
        return PackedLinear(self.panels, self.out_features, self.in_features, self.layout, entry)

    @classmethod
    def pack(cls, w: torch.Tensor, bf16: bool = True, amx: bool = False) -> PackedLinear | None:
        """Panels of ``w``: bf16 ones when ``bf16`` and every weight is exactly a bf16 value, AMX
        tiles of them when also ``amx`` and the machine has AMX (and K is a multiple of 32)."""
        lib = _lib_for(w)
        if lib is None:
            return None
        n, k = w.shape
        exact = bf16 and bf16_exact(w) and k % 2 == 0  # bf16 panels pair rows k, k+1
        if exact and amx and k % _AMX_K == 0 and (amx_lib := _load_amx()) is not None:
            return cls(_amx_tiles(w), n, k, "amx", amx_lib.packed_linear_fused_amx)
        with torch.no_grad():  # exact either way
            panels = _panel_layout(w, torch.bfloat16 if exact else torch.float32)  # [N/P, K, P]
        if exact:
            return cls(panels, n, k, "bf16", lib.packed_linear_fused_bf16)
        return cls(panels, n, k, "fp32", lib.packed_linear_fused)

    @classmethod
    def pack_int8(cls, w: torch.Tensor) -> PackedLinear | None:
        """Panels of ``w``'s int8 quantisation, one scale per output (row n: q = round(w[n] / s[n]),
        s[n] = max |w[n]| / 127): a quarter of fp32's bytes, half of bf16's. Not exact, so for a
        learned drafter's weights only, where a draft token streams its layers and head from
        memory and its numerics move acceptance, never the output (on the pre-trained selfspec
        drafter's held-out answers top-1/2 agreement moved by at most 0.006 against bf16)."""
        lib = _lib_for(w)
        if lib is None:
            return None
        n, k = w.shape
        with torch.no_grad():
            scale = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127.0  # [N]
            q = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8)  # [N, K]
            panels = _panel_layout(q, torch.int8)  # [N/P, K, P]
            scales = torch.zeros(panels.shape[0] * panels.shape[2], dtype=torch.float32, device="cpu")
            scales[:n] = scale
            buf = torch.cat([panels.view(-1), scales.view(torch.int8)])  # panels, then scales
        return cls(buf, n, k, "int8", lib.packed_linear_fused_int8)

    @property
    def entry(self):
        """The C entry (ctypes function) for this layout and rounding: ``packed_linear_fused``,
        ``_bf16``, ``_int8``, ``_amx``, ``_amx_bf16a`` or ``_bf16dot`` (kernels/llama_layers.py calls
        it from C)."""
        return self._fused

    @property
    def nbytes(self) -> int:
        """Bytes one call reads from the weight (padding included)."""
        return self.panels.numel() * self.panels.element_size()

    def unpacked(self) -> torch.Tensor:
        """The weight as [N, K] again (tests, and the reference path)."""
        n, k = self.out_features, self.in_features
        if self.layout == "int8":  # the dequantised weight, q x s
            p = panel_width()
            count = -(-n // p)
            q = self.panels[: count * k * p].view(count, k, p).transpose(1, 2).reshape(-1, k)[:n]
            scales = self.panels[count * k * p :].view(torch.float32)[:n]  # [N]
            return q.float() * scales[:, None]
        if self.layout == "amx":  # [p, kb, s, kp, nn, i] -> [p, s, nn, kb, kp, i] = [N, K]
            return self.panels.permute(0, 2, 4, 1, 3, 5).reshape(-1, k)[:n].float()
        if self.layout == "bf16":  # [p, K/2, P, 2] -> [p, P, K/2, 2] = [N, K]
            return self.panels.permute(0, 2, 1, 3).reshape(-1, k)[:n].float()
        return self.panels.transpose(1, 2).reshape(-1, k)[:n].float()

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
        if self.rounds_activations:
            h = h.to(torch.bfloat16).float()
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
        y = torch.empty(*x.shape[:-1], self.out_features, dtype=torch.float32, device="cpu")  # [..., N]
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
