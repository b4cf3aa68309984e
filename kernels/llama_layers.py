"""LayerStack: a Llama-family model's decoder layers run in one native call per forward
(``kernels/native/llama_layers.c``; why: see its header).

The stack holds each layer's norm weights and packed projections (``PackedLinear``), and calls the
same ``packed_linear`` and ``decode_attention`` entries that a per-call forward would, in the same
order on the same inputs, from a C loop: results are bit for bit the per-call path's. Built only
where every piece runs natively (``LayerStack.build`` returns None otherwise; the caller keeps its
per-call loop).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from kernels import decode_attention, native_build, packed_linear, threads
from kernels.packed_linear import PackedLinear

_ptr = ctypes.c_void_p


class _Layer(ctypes.Structure):
    _fields_ = [(name, _ptr) for name in (
        "ln1", "ln2", "qkv", "o", "gu", "down", "qkv_fn", "o_fn", "gu_fn", "down_fn")]


class _Dims(ctypes.Structure):
    _fields_ = [(name, ctypes.c_long) for name in (
        "hidden", "heads", "kv_heads", "head_dim", "inter")] + [
        ("eps", ctypes.c_float), ("scale", ctypes.c_float)]


class _Attention(ctypes.Structure):
    _fields_ = [(name, _ptr) for name in ("fn", "cos", "sin", "cols", "rows", "mask")] + [
        (name, ctypes.c_long) for name in ("B", "Bc", "T", "C", "L")] + [("bf16", ctypes.c_int)]


def _declare(lib: ctypes.CDLL) -> None:
    lib.llama_layers.argtypes = [
        ctypes.POINTER(_Layer), ctypes.c_int, ctypes.POINTER(_Dims), ctypes.POINTER(_Attention),
        *[ctypes.POINTER(_ptr)] * 3, *[_ptr] * 5, ctypes.c_int,
    ]
    lib.llama_layers.restype = ctypes.c_int


def _load() -> ctypes.CDLL | None:
    return native_build.load("llama_layers", _declare)


def _address(fn) -> int:
    return ctypes.cast(fn, _ptr).value


LayerWeights = tuple[torch.Tensor, PackedLinear, PackedLinear, torch.Tensor, PackedLinear, PackedLinear]
"""(input norm [H], q|k|v [Hq*D + 2*Hkv*D, H], o [H, Hq*D], post-attention norm [H],
gate|up [2I, H], down [H, I]), as LlamaForward serves them."""


class LayerStack:
    def __init__(self, layers: Sequence[LayerWeights], lib: ctypes.CDLL, attention_fn: int, *,
                 heads: int, kv_heads: int, head_dim: int, eps: float, scale: float,
                 bf16_attention: bool = False):
        self._lib = lib
        self._keep = [t for layer in layers for t in layer]  # what the structs point into
        self._layers = (_Layer * len(layers))()
        for s, (ln1, qkv, o, ln2, gu, down) in zip(self._layers, layers):
            s.ln1, s.ln2 = ln1.data_ptr(), ln2.data_ptr()
            s.qkv, s.o, s.gu, s.down = (p.panels.data_ptr() for p in (qkv, o, gu, down))
            s.qkv_fn, s.o_fn, s.gu_fn, s.down_fn = (_address(p.entry) for p in (qkv, o, gu, down))
        self.num_layers = len(layers)
        self.hidden = layers[0][2].out_features
        self.inter = layers[0][5].in_features
        self.q_dim = heads * head_dim
        self.qkv_dim = layers[0][1].out_features
        self._dims = _Dims(self.hidden, heads, kv_heads, head_dim, self.inter, eps, scale)
        self._attention_fn = attention_fn
        self.bf16_attention = bf16_attention
        """Attention on bf16 operands (``decode_attention(..., bf16=True)``)."""

    @classmethod
    def build(cls, layers: Sequence[LayerWeights], bf16_attention: bool = False,
              **dims) -> LayerStack | None:
        """The stack, or None where the native loop cannot run these layers (a kernel not built,
        a projection not packed, a norm weight not a contiguous fp32 CPU tensor).
        ``bf16_attention``: the caller has checked ``decode_attention.bf16_takes``."""
        lib = _load()
        attention = decode_attention._load()
        if lib is None or attention is None or not layers:
            return None
        for ln1, qkv, o, ln2, gu, down in layers:
            if not all(isinstance(p, PackedLinear) for p in (qkv, o, gu, down)):
                return None
            if not all(n.dtype == torch.float32 and n.device.type == "cpu" and n.is_contiguous()
                       for n in (ln1, ln2)):
                return None
        return cls(layers, lib, _address(attention.decode_attention), bf16_attention=bf16_attention,
                   **dims)

    def native_args(self) -> tuple[int, int, int, int]:
        """Addresses of ``llama_layers`` and of its layers, dims and attention-kernel arguments, for
        native code that runs these layers itself (kernels/draft_chain.py); valid while this
        stack lives."""
        return (_address(self._lib.llama_layers), ctypes.addressof(self._layers),
                ctypes.addressof(self._dims), self._attention_fn)

    def __call__(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cols: torch.Tensor,
        mask: torch.Tensor,
        keys: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
        rows: torch.Tensor | None = None,
        hidden_layers: frozenset[int] = frozenset(),
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """h [B, Tq, H] (or [N, H] with ``rows``: each token a row of its own, Tq = 1) the layers'
        input; the attention arguments as ``decode_attention`` takes them: cos, sin [B, Tq, D],
        cols [B, Tq] int64, mask [B, Tq, L] bool, keys/values: each layer's cache buffers
        [Bc, Hkv, C, D], rows [B] int64 or None. Returns (h after the last layer, {i: h after
        layer i - 1} for i in ``hidden_layers``, 1 <= i < num_layers), shaped as the input h."""
        shape = h.shape
        b, t = cols.shape
        tokens = b * t
        if h.numel() != tokens * self.hidden or len(keys) != self.num_layers:
            raise ValueError(f"h {tuple(shape)} is not {b} x {t} tokens of {self.hidden}")
        if (cos.shape[:2] != (b, t) or sin.shape != cos.shape or mask.shape[:2] != (b, t)
                or mask.dtype != torch.bool or cols.dtype != torch.int64
                or (rows is not None and (rows.shape != (b,) or rows.dtype != torch.int64))):
            raise ValueError("cos/sin [B, Tq, D], cols [B, Tq] int64, mask [B, Tq, L] bool, rows [B]")
        if not (decode_attention.takes(h, cos, sin, cols, mask)
                and decode_attention.cache_takes(keys[0], values[0], self.bf16_attention)):
            raise ValueError("the layer stack takes contiguous fp32 CPU tensors (a bf16 cache on "
                             "bf16 operands)")
        out = h.reshape(tokens, self.hidden).clone()  # [T, H], updated in place layer by layer
        widths = (self.hidden, self.qkv_dim, self.q_dim, 2 * self.inter)  # h2, qkv, att, gu
        scratch = torch.empty(tokens * sum(widths), device="cpu")  # each a contiguous [T, width] block
        starts = [scratch.data_ptr() + 4 * tokens * sum(widths[:j]) for j in range(len(widths))]
        captured = {i: torch.empty_like(out) for i in hidden_layers if 0 < i < self.num_layers}
        capacity = keys[0].shape[2]
        att_args = _Attention(
            self._attention_fn, cos.data_ptr(), sin.data_ptr(), cols.data_ptr(),
            rows.data_ptr() if rows is not None else None, mask.data_ptr(),
            b, keys[0].shape[0], t, capacity, mask.shape[-1],
            decode_attention.bf16_bits(self.bf16_attention, keys[0]),
        )
        n = self.num_layers
        k_ptrs = (_ptr * n)(*(k.data_ptr() for k in keys))
        v_ptrs = (_ptr * n)(*(v.data_ptr() for v in values))
        hid = (_ptr * n)(*(captured[i + 1].data_ptr() if i + 1 in captured else None
                           for i in range(n)))
        rc = self._lib.llama_layers(
            self._layers, n, ctypes.byref(self._dims), ctypes.byref(att_args), k_ptrs, v_ptrs,
            hid, out.data_ptr(), *starts,
            threads.kernel_threads(),
        )
        if rc != 0:
            raise ValueError(
                f"llama_layers: layer {-rc - 1} refused its arguments (cols outside [0, L), rows "
                f"outside the cache, or L > capacity {capacity})"
            )
        return out.view(shape), {i: c.view(shape) for i, c in captured.items()}


def available() -> bool:
    """Whether the layer loop and the kernels it calls are built and loaded."""
    return _load() is not None and packed_linear.available() and decode_attention.available()
