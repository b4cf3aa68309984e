"""DraftChain: a learned drafter's greedy draft for one request in one native call
(``kernels/native/draft_chain.c``; why: see its header).

It commits the request's new inputs to the drafter's cache and drafts k positions of m candidates
each, running the drafter's ``LayerStack`` and packed head exactly as the per-call path does (the
same kernels, in the same order, on the same inputs: the same hidden states and logits to the
bit), so a drafter may take it for its common case (one request, greedy) and keep the per-call
path for the rest.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from kernels import decode_attention, native_build, threads
from kernels.llama_layers import LayerStack, _address
from kernels.packed_linear import PackedLinear

_ptr = ctypes.c_void_p


class ChainModel(ctypes.Structure):
    _fields_ = [
        ("layers", _ptr), ("layer_args", _ptr), ("num_layers", ctypes.c_int), ("dims", _ptr),
        ("attention", _ptr), ("bf16", ctypes.c_int), ("embed", _ptr), ("vocab", ctypes.c_long),
        ("cos", _ptr), ("sin", _ptr), ("positions", ctypes.c_long), ("norm", _ptr), ("head", _ptr),
        ("head_fn", _ptr), ("head_rows", ctypes.c_long), ("vocab_map", _ptr),
    ]


def _declare(lib: ctypes.CDLL) -> None:
    lib.draft_chain.argtypes = [
        ctypes.POINTER(ChainModel), ctypes.POINTER(_ptr), ctypes.POINTER(_ptr), ctypes.c_long,
        _ptr, ctypes.c_long, ctypes.c_long, ctypes.c_long, _ptr, ctypes.c_int, ctypes.c_int,
        _ptr, _ptr, _ptr, ctypes.c_int,
    ]
    lib.draft_chain.restype = ctypes.c_int


@dataclass
class Draft:
    """What one call drafted: per position, its m candidates' token ids and probabilities (most
    likely first; position j + 1 was drafted after position j's first candidate), and the hidden
    state [H] after the last committed input."""

    ids: list[list[int]]  # [k][m]
    probs: list[list[float]]  # [k][m]
    last_hidden: torch.Tensor  # [H]


class DraftChain:
    def __init__(self, lib: ctypes.CDLL, stack: LayerStack, embed: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, norm: torch.Tensor, head: PackedLinear, bf16_bits: int,
                 vocab_map: torch.Tensor | None):
        self._lib = lib
        self.stack = stack
        self.hidden = stack.hidden
        self.head_rows = head.out_features
        self.positions = cos.shape[0]
        self._keep = (embed, cos, sin, norm, head, vocab_map)  # what the struct points into
        layers_fn, layer_args, dims, attention = stack.native_args()
        self._model = ChainModel(
            layers_fn, layer_args, stack.num_layers, dims, attention, bf16_bits, embed.data_ptr(),
            embed.shape[0], cos.data_ptr(), sin.data_ptr(), cos.shape[0], norm.data_ptr(),
            head.panels.data_ptr(), _address(head.entry), head.out_features,
            vocab_map.data_ptr() if vocab_map is not None else None,
        )

    @classmethod
    def build(cls, stack: LayerStack | None, embed: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
              norm: torch.Tensor, head, kv_dtype: torch.dtype,
              vocab_map: torch.Tensor | None = None) -> DraftChain | None:
        """The chain over a drafter's layer ``stack``, input ``embed`` [V, H], rotary tables
        ``rope`` (cos, sin [P, D]), final ``norm`` [H] and packed ``head`` (at the draft
        vocabulary; ``vocab_map`` [Vd] the token id of each of its rows), for caches of
        ``kv_dtype``; None where any of them cannot run natively."""
        lib = native_build.load("draft_chain", _declare)
        if lib is None or stack is None or rope is None or not isinstance(head, PackedLinear):
            return None
        tensors = (embed, *rope, norm) + ((vocab_map,) if vocab_map is not None else ())
        if not all(t.device.type == "cpu" and t.is_contiguous() for t in tensors):
            return None
        if not all(t.dtype == torch.float32 for t in (embed, *rope, norm)):
            return None
        if vocab_map is not None and (vocab_map.dtype != torch.int64 or vocab_map.shape != (head.out_features,)):
            return None
        if head.in_features != stack.hidden or embed.shape[1] != stack.hidden:
            return None
        if not decode_attention.cache_dtype_takes(kv_dtype, stack.bf16_attention):
            return None
        bits = decode_attention.bf16_bits(stack.bf16_attention, torch.empty(0, dtype=kv_dtype))
        return cls(lib, stack, embed, rope[0], rope[1], norm, head, bits, vocab_map)

    def fits(self, col: int, pos: int, pending: int, k: int, capacity: int) -> bool:
        """Whether a call with these columns and positions stays within the cache's ``capacity``
        and the rotary table."""
        return col + pending + k - 1 <= capacity and pos + pending + k - 1 <= self.positions

    def __call__(self, keys: list[torch.Tensor], values: list[torch.Tensor], tokens: list[int], col: int,
                 pos: int, last_hidden: torch.Tensor | None, k: int, m: int) -> Draft:
        """Commit ``tokens`` (the request's inputs since its last call) at cache columns ``col``..
        and rotary positions ``pos``.. (per layer ``keys``/``values`` [Hkv, C, D], the request's
        own buffers), then draft ``k`` positions of ``m`` (1..64) candidates from there (from
        ``last_hidden`` [H] when there is no token to commit). ValueError where the kernel refuses
        its arguments (a token outside the vocabulary, columns past the buffers)."""
        n = self.stack.num_layers
        q = len(tokens)
        k_ptrs = (_ptr * n)(*(t.data_ptr() for t in keys))
        v_ptrs = (_ptr * n)(*(t.data_ptr() for t in values))
        token_buf = (ctypes.c_int64 * max(q, 1))(*tokens)
        ids = (ctypes.c_int64 * (k * m))()
        probs = (ctypes.c_float * (k * m))()
        last = torch.empty(self.hidden)
        rc = self._lib.draft_chain(
            ctypes.byref(self._model), k_ptrs, v_ptrs, keys[0].shape[1], ctypes.addressof(token_buf), q, col,
            pos, last_hidden.data_ptr() if last_hidden is not None else None, k, m,
            ctypes.addressof(ids), ctypes.addressof(probs), last.data_ptr(), threads.kernel_threads(),
        )
        if rc != 0:
            raise ValueError(f"draft_chain refused its arguments ({rc}): {q} tokens at column {col}, "
                             f"position {pos}, k={k}, m={m}, capacity {keys[0].shape[1]}")
        return Draft([ids[j * m:(j + 1) * m] for j in range(k)], [probs[j * m:(j + 1) * m] for j in range(k)],
                     last)
