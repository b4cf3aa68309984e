"""Parts of a Hugging Face Llama forward, for a student that computes only what it reads.

A student (trainer/students.py) reads its last layer's output only at its rows: the positions whose
logits a loss or a held-out score uses, ~45 % of a packed training sequence and ~40 % of a held-out
trace (the prompt's positions are context, never read). The last layer's queries, attention output
and MLP are therefore computed at those positions only; its keys and values, which every position
contributes, everywhere. A selfspec student also starts its forward after the shared target layers,
whose output is kept (trainer/frozen_prefix.py). The same weights and the same math as
``LlamaDecoderLayer`` (tests compare against the full forward).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, repeat_kv, rotate_half


def llama_layers(inner: torch.nn.Module) -> bool:
    """Whether every decoder layer of ``inner`` is a ``LlamaDecoderLayer`` (what ``layer_at_rows``
    mirrors; SmolLM2 and every drafter built from it are)."""
    layers = getattr(inner, "layers", None)
    return bool(layers) and all(isinstance(layer, LlamaDecoderLayer) for layer in layers)


def run_layers(inner: torch.nn.Module, hidden: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor,
               layers) -> torch.Tensor:
    """``layers`` of a Llama model (``inner``: its ``.model``) over ``hidden`` [B, L, H], as its own
    forward runs them (the same mask preparation and rotary embedding)."""
    from transformers.masking_utils import create_causal_mask

    attn = create_causal_mask(config=inner.config, inputs_embeds=hidden, attention_mask=mask, cache=None,
                              position_ids=position_ids)
    rope = inner.rotary_emb(hidden, position_ids=position_ids)  # (cos, sin) [B, L, hd]
    for layer in layers:
        hidden = layer(hidden, attention_mask=attn, position_embeddings=rope, position_ids=position_ids)
    return hidden


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, n, hd]; cos, sin [B, n, hd]."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


def layer_at_rows(inner: torch.nn.Module, layer: torch.nn.Module, hidden: torch.Tensor, position_ids: torch.Tensor,
                  mask: torch.Tensor, b_idx: torch.Tensor, t_idx: torch.Tensor) -> torch.Tensor:
    """One decoder layer's output at the rows ``(b_idx[n], t_idx[n])`` only -> [N, H].

    ``hidden`` [B, L, H] is the layer's input at every position; ``mask`` [B, 1, L, L] bool (True:
    attend), ``position_ids`` [B, L] as for the whole forward. Rows may repeat.
    """
    B, L, _ = hidden.shape
    flat, inverse = torch.unique(b_idx * L + t_idx, return_inverse=True)  # sorted: grouped by sequence
    ub, ut = flat // L, flat % L  # [U]
    counts = torch.bincount(ub, minlength=B)  # [B]
    R = int(counts.max())
    starts = torch.cumsum(counts, 0) - counts  # [B]
    slot = torch.arange(len(flat), device=flat.device) - starts[ub]  # [U] place within its sequence's queries
    qpos = torch.zeros(B, R, dtype=torch.long, device=flat.device)  # [B, R] query positions, right-padded with 0
    qpos[ub, slot] = ut
    gather = lambda x: x.gather(1, qpos[..., None].expand(B, R, x.shape[-1]))  # [B, L, D] -> [B, R, D]

    attn = layer.self_attn
    hd = attn.head_dim
    x = layer.input_layernorm(hidden)  # [B, L, H]
    q = attn.q_proj(gather(x)).view(B, R, -1, hd).transpose(1, 2)  # [B, nh, R, hd]
    k = attn.k_proj(x).view(B, L, -1, hd).transpose(1, 2)  # [B, nkv, L, hd]
    v = attn.v_proj(x).view(B, L, -1, hd).transpose(1, 2)
    cos, sin = inner.rotary_emb(hidden, position_ids=position_ids)  # [B, L, hd]
    q = _rotate(q, gather(cos), gather(sin))
    k = _rotate(k, cos, sin)
    k, v = repeat_kv(k, attn.num_key_value_groups), repeat_kv(v, attn.num_key_value_groups)
    sees = mask[:, 0].gather(1, qpos[..., None].expand(B, R, L))  # [B, R, L]
    sees[:, :, 0] |= ~sees.any(-1)  # padded query slots attend somewhere (else NaN); never read
    out = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=sees[:, None],
                                         scale=attn.scaling)  # [B, nh, R, hd]
    h = gather(hidden) + attn.o_proj(out.transpose(1, 2).reshape(B, R, -1))  # [B, R, H]
    h = h + layer.mlp(layer.post_attention_layernorm(h))
    return h[ub, slot][inverse]  # [N, H]
