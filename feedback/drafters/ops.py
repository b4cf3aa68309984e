"""Llama building blocks the drafters share: projections through kernels.thin_linear (with bf16
draft weights and bucketed bf16 gemms for long extends), the MLP, attention, and the rope settings
read from a target config.

``attend`` takes any cache with HF's ``update(key, value, layer_idx) -> (keys, values)`` signature
(``KVCache``) and an explicit boolean mask, so the trainer can use a ``DynamicCache`` (or none) and
serving its batched per-request caches.
"""

from __future__ import annotations

import functools
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kernels.thin_linear import MAX_TOKENS as THIN_LINEAR_MAX_TOKENS
from kernels.thin_linear import available as thin_linear_available
from kernels.thin_linear import thin_linear


class KVCache(Protocol):
    """HF ``Cache``-compatible: store this step's keys/values, return everything for the layer."""

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs): ...


def linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)`` through kernels.thin_linear: one pass over the weights for a few tokens when
    drafting on the CPU; F.linear itself when training (gradients) or on other devices. A layer
    given a ``draft_weight`` (a bf16 copy, see ``draft_in_bf16``) is read through that. A long
    extend (a request's history, at a hot swap or its first draft) is compute-bound: with the
    copy it runs as a bf16 gemm (oneDNN's bf16 dot products where the CPU has them: ~2x fp32's
    FMAs, measured), else through the fp32 weight."""
    if layer.bias is not None:
        return layer(x)
    w = getattr(layer, "draft_weight", None)
    if w is None or (torch.is_grad_enabled() and layer.weight.requires_grad):
        return thin_linear(x, layer.weight)  # training reads (and updates) the real weights
    if x.numel() > THIN_LINEAR_MAX_TOKENS * x.shape[-1]:  # many tokens
        if _bf16_gemm():
            return _bf16_gemm_bucketed(x, w)
        return F.linear(x, layer.weight)
    return thin_linear(x, w)


def gemm_rows_bucket(n: int) -> int:
    """``n`` rounded up to one of four sizes per power of two (16, 20, 24, 28, 32, 40, ...): at
    most 25 % more rows, and few distinct gemm shapes."""
    if n <= 16:
        return n
    step = 1 << (n.bit_length() - 3)
    return -(-n // step) * step


def _bf16_gemm_bucketed(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, w)`` in bf16, returned as fp32, with the rows padded to ``gemm_rows_bucket``.
    Why: oneDNN builds (JIT-compiles) a kernel for every new gemm shape, ~1 ms per projection;
    histories have every length, so a drafter's first extend of a request (at its admission or a
    hot swap) paid ~14 ms of compiles per request for a 2-layer drafter. Rows are independent, so
    the padding changes nothing in the real rows' results but their rounding."""
    flat = x.reshape(-1, x.shape[-1])  # [N, K]
    n = flat.shape[0]
    m = gemm_rows_bucket(n)
    padded = flat.new_zeros(m, flat.shape[1], dtype=torch.bfloat16)  # [M, K]
    padded[:n] = flat
    out = F.linear(padded, w)[:n].float()  # [N, O]
    return out.reshape(*x.shape[:-1], out.shape[-1])


@functools.cache
def _bf16_gemm() -> bool:
    """Whether this CPU runs bf16 matmuls natively (AVX-512 BF16 / AMX), not emulated."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def draft_in_bf16(module: nn.Module) -> int:
    """Give every bias-free fp32 CPU Linear under ``module`` a bf16 ``draft_weight`` that ``linear``
    reads when drafting: half the bytes per draft token (a draft's numerics change how often it is
    accepted, never what is emitted). Only where the native kernel runs (its fallback would widen
    the weights on every call). Returns the number of layers given one."""
    if not thin_linear_available():
        return 0
    n = 0
    for m in module.modules():
        if isinstance(m, nn.Linear) and m.bias is None and m.weight.dtype == torch.float32 \
                and m.weight.device.type == "cpu":
            m.draft_weight = m.weight.detach().to(torch.bfloat16)
            n += 1
    return n


def mlp(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A Llama MLP (``down(silu(gate(x)) * up(x))``) with its projections through ``linear``."""
    return linear(module.down_proj, F.silu(linear(module.gate_proj, x)) * linear(module.up_proj, x))


def attend(
    attn: nn.Module,
    x: torch.Tensor,  # [B, L, D_in]
    cos: torch.Tensor,  # [B, L, hd]
    sin: torch.Tensor,  # [B, L, hd]
    cache: KVCache | None,
    layer_idx: int,
    mask: torch.Tensor | None,  # [B, L, Lk] or [B, 1, L, Lk] bool (True = attend), None = causal
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> torch.Tensor:
    """Llama self-attention over ``attn``'s q/k/v/o projections (HF ``LlamaAttention`` or ours)."""
    b, n, _ = x.shape
    q = linear(attn.q_proj, x).view(b, n, num_heads, head_dim).transpose(1, 2)  # [B, nh, L, hd]
    k = linear(attn.k_proj, x).view(b, n, num_kv_heads, head_dim).transpose(1, 2)  # [B, kvh, L, hd]
    v = linear(attn.v_proj, x).view(b, n, num_kv_heads, head_dim).transpose(1, 2)  # [B, kvh, L, hd]
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    past = 0
    if cache is not None:
        past = _cache_length(cache, layer_idx)
        k, v = cache.update(k, v, layer_idx)  # [B, kvh, Lk, hd]
    if mask is None and n > 1:
        cols = torch.arange(k.shape[2], device=x.device)
        rows = torch.arange(n, device=x.device) + past
        mask = (cols[None, :] <= rows[:, None])[None]  # [1, L, Lk]
    if mask is not None and mask.dim() == 3:
        mask = mask[:, None]  # [B, 1, L, Lk]
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, enable_gqa=num_heads != num_kv_heads
    )
    return linear(attn.o_proj, out.transpose(1, 2).reshape(b, n, num_heads * head_dim))  # [B, L, H]


def _cache_length(cache, layer_idx: int) -> int:
    if hasattr(cache, "get_seq_length"):
        return int(cache.get_seq_length(layer_idx))
    return int(getattr(cache, "length", 0))


def _rope_parameters(cfg: LlamaConfig) -> dict:
    params = getattr(cfg, "rope_parameters", None)
    if params:
        return dict(params)
    return {"rope_type": "default", "rope_theta": float(getattr(cfg, "rope_theta", 10000.0))}
