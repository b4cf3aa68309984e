"""The EAGLE-3 head, shared by serving (drafting) and the trainer (distillation).

``EagleHead``: an EAGLE-3-style head on the target's hidden states, laid out like SGLang's
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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from feedback.drafters.ops import KVCache, _cache_length, attend, linear, mlp
from feedback.drafters.shapes import LlamaShapes
from feedback.drafters.vocab import DEFAULT_DRAFT_VOCAB_SIZE, day0_draft_vocab, special_token_ids


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


class EagleHeadConfig(LlamaShapes):
    """Shapes of an EagleHead (saved in the artifact's config.json)."""

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
            **LlamaShapes.of(tc),
            target_hidden_size=int(tc.hidden_size),
            target_num_layers=n_layers,
            target_vocab_size=vocab,
            draft_vocab_size=min(int(draft_vocab_size), vocab),
            feature_layers=layers,
        )

    def llama_config(self) -> LlamaConfig:
        """A LlamaConfig with this head's shapes (for HF's MLP/RMSNorm/rotary modules)."""
        return LlamaConfig(**self.model_dump(include=set(LlamaShapes.model_fields)),
                           vocab_size=self.target_vocab_size, num_hidden_layers=1, mlp_bias=False)


def check_target(config: EagleHeadConfig, target_model: nn.Module) -> None:
    """Refuse a target whose shapes differ from the ones the head was cut from: the fingerprint
    names the target, these are what the head reads of it (its features, embeddings, vocabulary)."""
    tc = target_model.config
    layers = int(tc.num_hidden_layers)
    mismatches = {
        name: (want, got)
        for name, want, got in (
            ("target_num_layers", config.target_num_layers, layers),
            ("target_hidden_size", config.target_hidden_size, int(tc.hidden_size)),
            ("hidden_size", config.hidden_size, int(tc.hidden_size)),
            ("target_vocab_size", config.target_vocab_size,
             int(target_model.get_output_embeddings().weight.shape[0])),
        )
        if want != got
    }
    if mismatches:
        raise ValueError(f"EAGLE head does not fit this target: {mismatches}")
    if any(not 0 <= i < layers for i in config.feature_layers):
        raise ValueError(f"EAGLE head reads feature layers {config.feature_layers}: this target's "
                         f"hidden_states indices are in [0, {layers})")


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
