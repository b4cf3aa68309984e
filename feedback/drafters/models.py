"""Learned drafter models, shared by serving (drafting) and the trainer (distillation).

Two kinds:

- ``EagleHead``: an EAGLE-3-style head on the target's hidden states, laid out like SGLang's
  ``LlamaForCausalLMEagle3`` so it exports without renaming (see feedback/registry/eagle3_export.py).
  One draft position pairs the target feature f_t (HF ``hidden_states`` at ``feature_layers``,
  concatenated, computed from tokens <= t) with the embedding of token t+1 and predicts token t+2:

      h   = fc(f_t)                                       # [.., 3H] -> [.., H]  (real features)
            or the head's own previous output             # [.., H]              (draft steps)
      x   = cat(input_layernorm(embed(tok_{t+1})), hidden_norm(h))   # [.., 2H]: attention input
      h1  = h + attn(x)                                   # q/k/v take 2H, o_proj gives H
      out = h1 + mlp(post_attention_layernorm(h1))        # pre-norm: fed back as the next h
      logits = lm_head(norm(out))                         # [.., Vd] draft vocabulary

  The 2H attention input (not a projection) is EAGLE-3's and SGLang's choice; keeping it makes
  the export a pure rename-free copy. The token embedding is the target's own table, shared by
  reference (``attach_embeddings``) and never saved: it is pinned by the target fingerprint.
  The draft vocabulary (``d2t``/``t2d`` buffers, SGLang layout: target_id = draft_id + d2t[draft_id];
  t2d[target_id] is True iff the target id is in the draft vocabulary) keeps the lm_head read small.

- Standalone: a plain ``transformers.LlamaForCausalLM`` with few layers on the target's tokenizer
  (what SGLang's STANDALONE runs); ``StandaloneConfig`` is its serialisable config.

Attention in both goes through ``attend``, which takes any cache with HF's
``update(key, value, layer_idx) -> (keys, values)`` signature and an explicit boolean mask, so the
trainer can use a ``DynamicCache`` (or none) and serving its batched per-request caches.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Literal, Protocol

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from kernels.thin_linear import MAX_TOKENS as THIN_LINEAR_MAX_TOKENS
from kernels.thin_linear import available as thin_linear_available
from kernels.thin_linear import thin_linear

DEFAULT_DRAFT_VOCAB_SIZE = 16384


# ----------------------------------------------------------------------------------------------
# Shared pieces
# ----------------------------------------------------------------------------------------------


class KVCache(Protocol):
    """HF ``Cache``-compatible: store this step's keys/values, return everything for the layer."""

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs): ...


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's (2, L//2, L-3) as HF ``hidden_states`` indices (= SGLang's default capture ids);
    (1, L//2, L-1) for targets too shallow for those to be distinct."""
    layers = (2, num_layers // 2, num_layers - 3)
    if not (0 < layers[0] < layers[1] < layers[2] < num_layers):
        layers = (1, num_layers // 2, num_layers - 1)
    if not (0 < layers[0] < layers[1] < layers[2] < num_layers):
        raise ValueError(f"a {num_layers}-layer target has no three distinct feature layers")
    return layers


def gather_features(hidden_states: Sequence[torch.Tensor], layers: Sequence[int]) -> torch.Tensor:
    """HF ``output_hidden_states`` tuple -> [B, T, len(layers) * H] drafter features."""
    return torch.cat([hidden_states[i] for i in layers], dim=-1)  # [B, T, F]


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


def _rope_config(
    hidden_size: int, num_heads: int, head_dim: int, rope_parameters: dict, max_pos: int
):
    return LlamaConfig(
        hidden_size=hidden_size,
        num_attention_heads=num_heads,
        head_dim=head_dim,
        rope_parameters=dict(rope_parameters),
        max_position_embeddings=max_pos,
    )


def _rope_parameters(cfg: LlamaConfig) -> dict:
    params = getattr(cfg, "rope_parameters", None)
    if params:
        return dict(params)
    return {"rope_type": "default", "rope_theta": float(getattr(cfg, "rope_theta", 10000.0))}


def checked_vocab_ids(ids, vocab_size: int) -> torch.Tensor:
    """A draft vocabulary as [Vd] int64 CPU target ids: non-empty, 1-D, integer, strictly
    increasing, inside [0, vocab_size). ValueError, saying which, otherwise."""
    ids = torch.as_tensor(ids)
    if ids.ndim != 1 or ids.numel() == 0 or ids.is_floating_point() or ids.dtype == torch.bool:
        raise ValueError(f"a draft vocabulary is a non-empty 1-D tensor of integer ids, got "
                         f"{ids.dtype} {tuple(ids.shape)}")
    ids = ids.to(torch.int64).cpu().contiguous()
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"draft vocabulary ids outside the target vocabulary [0, {vocab_size})")
    if not bool((ids[1:] > ids[:-1]).all()):
        raise ValueError("draft vocabulary ids must be sorted and distinct")
    return ids


def day0_draft_vocab(
    vocab_size: int,
    draft_vocab_size: int,
    special_ids: Sequence[int] = (),
    frequencies: torch.Tensor | Sequence[float] | None = None,
) -> torch.Tensor:
    """Sorted [Vd] target ids of a draft vocabulary.

    Without ``frequencies`` it is the lowest ids (BPE ids are roughly frequency-ordered); with a
    [V] frequency table (the trainer counts traffic) it is the most frequent ids, ties to the lower
    id. ``special_ids`` (EOS and other specials) are always included.
    """
    draft_vocab_size = min(draft_vocab_size, vocab_size)
    specials = sorted({int(i) for i in special_ids if i is not None and 0 <= int(i) < vocab_size})
    if len(specials) > draft_vocab_size:
        raise ValueError(
            f"{len(specials)} special tokens do not fit a {draft_vocab_size}-token draft vocab"
        )
    if frequencies is None:
        score = -torch.arange(vocab_size, dtype=torch.float64)  # lower id first
    else:
        score = torch.as_tensor(frequencies, dtype=torch.float64).clone()
        if score.shape != (vocab_size,):
            raise ValueError(
                f"frequencies must have shape ({vocab_size},), got {tuple(score.shape)}"
            )
    if specials:
        score[specials] = float("inf")
    # stable sort on -score keeps the lower id first among equal scores
    order = torch.sort(-score, stable=True).indices[:draft_vocab_size]  # [Vd]
    return torch.sort(order).values.to(torch.long)


def special_token_ids(tokenizer, config=None) -> list[int]:
    """EOS/BOS/PAD and every tokenizer special id (may be empty for ids-only test targets)."""
    ids: set[int] = set()
    if tokenizer is not None:
        ids.update(int(i) for i in getattr(tokenizer, "all_special_ids", []) or [])
    for src in (tokenizer, config):
        for name in ("eos_token_id", "bos_token_id", "pad_token_id"):
            v = getattr(src, name, None) if src is not None else None
            if isinstance(v, int):
                ids.add(v)
            elif isinstance(v, (list, tuple)):
                ids.update(int(i) for i in v)
    return sorted(ids)


# ----------------------------------------------------------------------------------------------
# EAGLE-3 head
# ----------------------------------------------------------------------------------------------


class EagleHeadConfig(BaseModel):
    """Shapes of an EagleHead (saved in the artifact's config.json)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    hidden_act: str = "silu"
    rope_parameters: dict = Field(
        default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0}
    )
    max_position_embeddings: int = 8192
    target_hidden_size: int
    target_num_layers: int
    target_vocab_size: int
    draft_vocab_size: int
    feature_layers: tuple[int, ...]
    """HF ``hidden_states`` indices of the target layers whose outputs are concatenated into one
    feature row (index i = input of decoder layer i; SGLang capture id i, config id i-1)."""

    @property
    def feature_size(self) -> int:
        return self.target_hidden_size * len(self.feature_layers)

    @classmethod
    def for_target(
        cls,
        target_config: LlamaConfig,
        feature_layers: Sequence[int] | None = None,
        draft_vocab_size: int = DEFAULT_DRAFT_VOCAB_SIZE,
        vocab_size: int | None = None,
    ) -> EagleHeadConfig:
        """Same width as the target (the decoder layer can start from the target's last layer)."""
        tc = target_config
        n_layers = int(tc.num_hidden_layers)
        layers = tuple(int(i) for i in (feature_layers or default_feature_layers(n_layers)))
        if not layers or any(not 0 <= i < n_layers for i in layers):
            raise ValueError(
                f"feature_layers {layers} must be HF hidden_states indices in [0, {n_layers})"
            )
        vocab = int(vocab_size or tc.vocab_size)
        return cls(
            hidden_size=int(tc.hidden_size),
            intermediate_size=int(tc.intermediate_size),
            num_attention_heads=int(tc.num_attention_heads),
            num_key_value_heads=int(tc.num_key_value_heads),
            head_dim=int(getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads),
            rms_norm_eps=float(tc.rms_norm_eps),
            hidden_act=str(tc.hidden_act),
            rope_parameters=_rope_parameters(tc),
            max_position_embeddings=int(tc.max_position_embeddings),
            target_hidden_size=int(tc.hidden_size),
            target_num_layers=n_layers,
            target_vocab_size=vocab,
            draft_vocab_size=min(int(draft_vocab_size), vocab),
            feature_layers=layers,
        )

    def llama_config(self) -> LlamaConfig:
        """A LlamaConfig with this head's shapes (for HF's MLP/RMSNorm/rotary modules)."""
        return LlamaConfig(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            hidden_act=self.hidden_act,
            rope_parameters=dict(self.rope_parameters),
            max_position_embeddings=self.max_position_embeddings,
            vocab_size=self.target_vocab_size,
            num_hidden_layers=1,
            mlp_bias=False,
        )


class EagleAttention(nn.Module):
    """q/k/v read the 2H concat of (normed embedding, normed hidden); o_proj writes H."""

    def __init__(self, cfg: EagleHeadConfig):
        super().__init__()
        d_in = 2 * cfg.hidden_size
        self.q_proj = nn.Linear(d_in, cfg.num_attention_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(d_in, cfg.num_key_value_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(d_in, cfg.num_key_value_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, bias=False)


class EagleDecoderLayer(nn.Module):
    """SGLang's ``midlayer``: parameter names match its EAGLE3 checkpoints."""

    def __init__(self, cfg: EagleHeadConfig):
        super().__init__()
        llama = cfg.llama_config()
        self.input_layernorm = LlamaRMSNorm(
            cfg.hidden_size, eps=cfg.rms_norm_eps
        )  # on the embedding
        self.hidden_norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)  # on the fed hidden
        self.self_attn = EagleAttention(cfg)
        self.post_attention_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = LlamaMLP(llama)


class EagleHead(nn.Module):
    """EAGLE-3 head. Trainable state: fc, midlayer, norm, lm_head; buffers d2t/t2d (saved);
    the embedding table is the target's (attached, not saved)."""

    def __init__(self, config: EagleHeadConfig):
        super().__init__()
        self.config = config
        c = config
        self.fc = nn.Linear(c.feature_size, c.hidden_size, bias=False)
        self.midlayer = EagleDecoderLayer(c)
        self.norm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(
            _rope_config(
                c.hidden_size,
                c.num_attention_heads,
                c.head_dim,
                c.rope_parameters,
                c.max_position_embeddings,
            )
        )
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))  # [Vd]
        self.register_buffer("t2d", torch.zeros(c.target_vocab_size, dtype=torch.bool))  # [V]
        # derived from d2t, not saved: draft id -> target id, target id -> draft id (-1: absent)
        self.register_buffer(
            "draft_to_target", torch.zeros(c.draft_vocab_size, dtype=torch.long), persistent=False
        )
        self.register_buffer(
            "target_to_draft",
            torch.full((c.target_vocab_size,), -1, dtype=torch.long),
            persistent=False,
        )
        self.register_buffer("embed_weight", None, persistent=False)
        self.set_draft_vocab(torch.arange(c.draft_vocab_size))
        self.register_load_state_dict_post_hook(
            lambda module, _incompatible: module._refresh_vocab_maps()
        )

    # -- vocabulary ---------------------------------------------------------------------------

    def set_draft_vocab(self, target_ids: torch.Tensor) -> None:
        """[Vd] sorted distinct target ids -> d2t/t2d buffers (SGLang convention)."""
        ids = torch.as_tensor(target_ids, dtype=torch.long, device=self.d2t.device)
        if ids.shape != self.d2t.shape:
            raise ValueError(
                f"draft vocab must have {self.d2t.numel()} ids, got {tuple(ids.shape)}"
            )
        if ids.numel() and (ids.min() < 0 or ids.max() >= self.config.target_vocab_size):
            raise ValueError("draft vocab ids outside the target vocabulary")
        if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
            raise ValueError("draft vocab ids must be sorted and distinct")
        self.d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True
        self._refresh_vocab_maps()

    def _refresh_vocab_maps(self) -> None:
        ids = torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t  # [Vd]
        self.draft_to_target = ids
        t2d = torch.full((self.config.target_vocab_size,), -1, dtype=torch.long, device=ids.device)
        valid = (ids >= 0) & (ids < self.config.target_vocab_size)
        t2d[ids[valid]] = torch.nonzero(valid).squeeze(-1)
        self.target_to_draft = t2d

    def draft_vocab(self) -> torch.Tensor:
        """[Vd] target id of each draft id."""
        return self.draft_to_target

    def to_target_vocab(self, x: torch.Tensor) -> torch.Tensor:
        """[..., Vd] draft-vocab values -> [..., V], zero outside the draft vocabulary."""
        out = x.new_zeros(*x.shape[:-1], self.config.target_vocab_size)
        return out.index_copy_(-1, self.draft_to_target, x)

    # -- embeddings ---------------------------------------------------------------------------

    def attach_embeddings(self, weight: torch.Tensor) -> None:
        """Share the target's [V, H] input embedding table (by reference when dtype/device agree)."""
        if tuple(weight.shape) != (self.config.target_vocab_size, self.config.hidden_size):
            raise ValueError(
                f"embedding table {tuple(weight.shape)} does not match "
                f"({self.config.target_vocab_size}, {self.config.hidden_size})"
            )
        self.embed_weight = weight.detach()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_weight is None:
            raise RuntimeError(
                "EagleHead has no embeddings: call attach_embeddings(target embed weight)"
            )
        return F.embedding(input_ids, self.embed_weight).to(self.fc.weight.dtype)

    # -- forward ------------------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, L] target ids of tokens t+1
        hidden: torch.Tensor | None = None,  # [B, L, H] already-fused hidden (draft steps)
        *,
        features: torch.Tensor | None = None,  # [B, L, F] target features f_t (goes through fc)
        position_ids: torch.Tensor | None = None,  # [B, L]; default: cache length + arange
        cache: KVCache | None = None,
        attn_mask: torch.Tensor | None = None,  # [B, L, Lk] bool; None = causal
    ) -> torch.Tensor:
        """Returns the pre-norm output hidden [B, L, H]: feed it back as ``hidden`` for the next
        draft step, or call ``compute_logits`` on it."""
        if (hidden is None) == (features is None):
            raise ValueError("pass exactly one of hidden (fused, [.., H]) or features ([.., F])")
        if features is not None:
            hidden = linear(self.fc, features.to(self.fc.weight.dtype))  # [B, L, H]
        c = self.config
        b, n = input_ids.shape
        if position_ids is None:
            past = _cache_length(cache, 0) if cache is not None else 0
            position_ids = (torch.arange(n, device=input_ids.device) + past).expand(b, n)
        cos, sin = self.rotary_emb(hidden, position_ids)  # [B, L, hd]
        layer = self.midlayer
        x = torch.cat(
            [layer.input_layernorm(self.embed(input_ids)), layer.hidden_norm(hidden)], dim=-1
        )  # [B, L, 2H]
        h = hidden + attend(
            layer.self_attn,
            x,
            cos,
            sin,
            cache,
            0,
            attn_mask,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
        )  # [B, L, H]
        return h + mlp(layer.mlp, layer.post_attention_layernorm(h))  # [B, L, H]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] pre-norm hidden -> [..., Vd] draft-vocabulary logits."""
        return linear(self.lm_head, self.norm(hidden))


def eagle_from_target(
    target_model: nn.Module,
    *,
    feature_layers: Sequence[int] | None = None,
    draft_vocab: torch.Tensor | None = None,
    draft_vocab_size: int = DEFAULT_DRAFT_VOCAB_SIZE,
    special_ids: Sequence[int] = (),
    init: Literal["target", "random"] = "target",
    seed: int = 0,
) -> EagleHead:
    """Day-0 EagleHead for a Llama-architecture HF target (its embeddings attached).

    ``init="target"``: the decoder layer starts from the target's last layer where shapes allow
    (norms, o_proj, MLP; q/k/v get the target's weights in both halves of their 2H input), ``norm``
    from the target's final norm, lm_head rows copied for the draft vocabulary, ``fc`` small random.
    ``init="random"``: everything random (std 0.02), norms at one.
    The draft vocabulary is ``draft_vocab`` or the lowest ids plus ``special_ids``.
    """
    tc = target_model.config
    out_embed = target_model.get_output_embeddings().weight  # [V, H]
    vocab = int(out_embed.shape[0])
    if draft_vocab is None:
        draft_vocab = day0_draft_vocab(
            vocab, draft_vocab_size, special_ids or special_token_ids(None, tc)
        )
    cfg = EagleHeadConfig.for_target(
        tc, feature_layers, draft_vocab_size=len(draft_vocab), vocab_size=vocab
    )
    gen = torch.Generator().manual_seed(seed)
    head = EagleHead(cfg)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        head.set_draft_vocab(draft_vocab)
        if init == "target":
            last = target_model.model.layers[-1]
            mid = head.midlayer
            mid.input_layernorm.weight.copy_(last.input_layernorm.weight)
            mid.hidden_norm.weight.copy_(last.input_layernorm.weight)
            mid.post_attention_layernorm.weight.copy_(last.post_attention_layernorm.weight)
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(mid.mlp, name).weight.copy_(getattr(last.mlp, name).weight)
            mid.self_attn.o_proj.weight.copy_(last.self_attn.o_proj.weight)
            for name in ("q_proj", "k_proj", "v_proj"):
                w = getattr(last.self_attn, name).weight  # [out, H]
                getattr(mid.self_attn, name).weight.copy_(torch.cat([w, w], dim=1))  # [out, 2H]
            head.norm.weight.copy_(target_model.model.norm.weight)
            head.lm_head.weight.copy_(out_embed[draft_vocab])
        elif init != "random":
            raise ValueError(f"unknown eagle init {init!r} (target | random)")
    head = head.to(out_embed.dtype)
    head.attach_embeddings(target_model.get_input_embeddings().weight)
    return head.eval()


# ----------------------------------------------------------------------------------------------
# Standalone small LM
# ----------------------------------------------------------------------------------------------


class StandaloneConfig(BaseModel):
    """A small Llama causal LM on the target's vocabulary (saved in the artifact's config.json)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    hidden_act: str = "silu"
    rope_parameters: dict = Field(
        default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0}
    )
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    @classmethod
    def for_target(
        cls, target_config: LlamaConfig, num_layers: int = 2, vocab_size: int | None = None
    ):
        tc = target_config
        return cls(
            vocab_size=int(vocab_size or tc.vocab_size),
            hidden_size=int(tc.hidden_size),
            intermediate_size=int(tc.intermediate_size),
            num_hidden_layers=int(num_layers),
            num_attention_heads=int(tc.num_attention_heads),
            num_key_value_heads=int(tc.num_key_value_heads),
            head_dim=int(getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads),
            rms_norm_eps=float(tc.rms_norm_eps),
            hidden_act=str(tc.hidden_act),
            rope_parameters=_rope_parameters(tc),
            max_position_embeddings=int(tc.max_position_embeddings),
            tie_word_embeddings=bool(getattr(tc, "tie_word_embeddings", True)),
            bos_token_id=getattr(tc, "bos_token_id", None),
            eos_token_id=getattr(tc, "eos_token_id", None),
        )

    def llama_config(self) -> LlamaConfig:
        return LlamaConfig(**self.model_dump(), attention_bias=False, mlp_bias=False)


def build_standalone(config: StandaloneConfig) -> LlamaForCausalLM:
    return LlamaForCausalLM(config.llama_config()).eval()


def standalone_from_target(
    target_model: nn.Module,
    *,
    num_layers: int = 2,
    init: Literal["target-layers", "random"] = "target-layers",
    seed: int = 0,
) -> LlamaForCausalLM:
    """Day-0 standalone drafter. ``target-layers``: the target's embeddings, first ``num_layers``
    decoder layers, final norm and lm_head copied (the pre-study's 2-layer draft); ``random``:
    fresh HF initialisation."""
    tc = target_model.config
    vocab = int(target_model.get_output_embeddings().weight.shape[0])
    cfg = StandaloneConfig.for_target(tc, num_layers=num_layers, vocab_size=vocab)
    torch.manual_seed(seed)
    model = build_standalone(cfg)
    if init == "target-layers":
        if num_layers > tc.num_hidden_layers:
            raise ValueError(f"target has only {tc.num_hidden_layers} layers")
        src = target_model.state_dict()
        own = model.state_dict()
        with torch.no_grad():
            for name, t in own.items():
                if name.startswith("model.layers.") and int(name.split(".")[2]) >= num_layers:
                    continue
                if name in src and src[name].shape == t.shape:
                    t.copy_(src[name])
                elif name != "lm_head.weight" or not cfg.tie_word_embeddings:
                    raise ValueError(f"target has no tensor {name} of shape {tuple(t.shape)}")
    elif init != "random":
        raise ValueError(f"unknown standalone init {init!r} (target-layers | random)")
    return model.to(target_model.get_output_embeddings().weight.dtype).eval()
