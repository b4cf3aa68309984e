"""Standalone drafter: a small causal LM on the target's tokenizer (SGLang's STANDALONE).

Its per-request KV cache covers every committed token (the request's history, then each verify
step's accepted tokens); k draft tokens cost one extend over the new tokens plus k-1 decode steps.
The model is a plain ``LlamaForCausalLM``; drafting runs its layers through ``attend`` with batched
per-request caches. Optionally the lm_head is read only for a draft vocabulary (``draft_vocab``):
its probabilities then live on those ids only, which the returned distributions say exactly.
"""

from __future__ import annotations

import torch
from transformers import LlamaForCausalLM

from feedback.bus.trace import DrafterKind
from feedback.drafters.models import attend, draft_in_bf16, mlp
from kernels.thin_linear import thin_linear
from serving.drafters.base import DraftRequestView
from serving.drafters.learned import LearnedDrafter


class StandaloneNet:
    """DraftNet adapter over a LlamaForCausalLM."""

    def __init__(self, model: LlamaForCausalLM, draft_vocab: torch.Tensor | None = None, bf16: bool = False):
        """``bf16``: draft with bf16 copies of the layers' projections and the lm_head rows (the
        model's own weights stay as they are; the copies hang on its Linear modules as
        ``draft_weight``, see ``draft_in_bf16``: the drafter owns its model)."""
        cfg = model.config
        self.model = model.eval()
        self.num_layers = int(cfg.num_hidden_layers)
        self.num_heads = int(cfg.num_attention_heads)
        self.num_kv_heads = int(cfg.num_key_value_heads)
        self.head_dim = int(
            getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        )
        self.hidden_size = int(cfg.hidden_size)
        head = model.get_output_embeddings().weight  # [V, H]
        self.dtype = head.dtype
        self.target_vocab_size = int(head.shape[0])
        self.vocab_map = (
            None if draft_vocab is None else torch.as_tensor(draft_vocab, dtype=torch.long)
        )
        self.head_weight = (
            head if draft_vocab is None else head[self.vocab_map].contiguous()
        )  # [Vd, H]
        if bf16 and draft_in_bf16(model.model.layers):
            self.head_weight = self.head_weight.detach().to(torch.bfloat16)

    def _forward(self, tokens, positions, cache, mask):
        inner = self.model.model
        h = inner.embed_tokens(tokens)  # [B, L, H]
        cos, sin = inner.rotary_emb(h, positions)
        for i, layer in enumerate(inner.layers):
            h = h + attend(
                layer.self_attn,
                layer.input_layernorm(h),
                cos,
                sin,
                cache,
                i,
                mask,
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
            )
            h = h + mlp(layer.mlp, layer.post_attention_layernorm(h))
        return h  # [B, L, H] pre-norm

    def extend(self, tokens, features, positions, cache, mask):
        return self._forward(tokens, positions, cache, mask)

    def step(self, tokens, hidden, positions, cache, mask):
        return self._forward(tokens, positions, cache, mask)

    def logits(self, hidden):
        return thin_linear(self.model.model.norm(hidden), self.head_weight)  # [B, Vd]


class StandaloneDrafter(LearnedDrafter):
    kind = "standalone"
    source_kind = DrafterKind.STANDALONE

    def __init__(
        self,
        model: LlamaForCausalLM,
        version: str = "day0",
        draft_vocab: torch.Tensor | None = None,
        bf16: bool = True,
    ):
        """``bf16``: draft through bf16 copies of the weights (``StandaloneNet``); the self-
        speculative subclass shares its first layers with the target and keeps them fp32."""
        super().__init__(StandaloneNet(model, draft_vocab, bf16=bf16), version)
        self.model = model

    def _initial_inputs(self, view: DraftRequestView, features: torch.Tensor | None):
        return view.token_ids, None


class SelfSpecDrafter(StandaloneDrafter):
    """The target's first layers + a trained adapter + its norm and lm_head
    (feedback/drafters/from_target.py): drafted like a standalone LM whose shared layers are the
    target's own modules, reading the lm_head only at the adapter's draft vocabulary."""

    kind = "selfspec"
    source_kind = DrafterKind.SELFSPEC

    def __init__(self, model: LlamaForCausalLM, version: str = "day0"):
        super().__init__(model, version, draft_vocab=getattr(model, "selfspec_draft_vocab", None), bf16=False)
