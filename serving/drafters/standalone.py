"""Standalone drafter: a small causal LM on the target's tokenizer (SGLang's STANDALONE).

Its per-request KV cache covers every committed token (the request's history, then each verify
step's accepted tokens); k draft tokens cost one extend over the new tokens plus k-1 decode steps.
The model is a plain ``LlamaForCausalLM``. Where the native kernels run (fp32 on the CPU) it drafts
on the target's own decode path (``PackedDraftNet``: packed bf16 panels, native attention over the
drafter's per-request caches); elsewhere its modules run one by one (``StandaloneNet``, through
``attend``). Optionally the lm_head is read only for a draft vocabulary (``draft_vocab``): its
probabilities then live on those ids only, which the returned distributions say exactly.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import LlamaForCausalLM

from feedback.bus.trace import DrafterKind
from feedback.drafters.ops import attend, draft_in_bf16, mlp
from feedback.registry.artifact_keys import DAY0_VERSION
from kernels import decode_attention as native_attention
from kernels import packed_linear
from kernels.draft_chain import DraftChain
from kernels.thin_linear import thin_linear
from serving.drafters.base import DraftRequestView
from serving.drafters.draft_kv import BatchKV
from serving.drafters.learned import LearnedDrafter
from serving.engine.forward_cache import drafter_forward
from serving.engine.llama_forward import LlamaForward


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
        self.kv_dtype = self.dtype
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


DRAFT_INT8 = True
"""Whether a packed draft net serves int8 panels (``PackedLinear.pack_int8``): a one-token draft
streams its layers and head from memory, so half the bytes of bf16 is most of a draft's price; on
the pre-trained selfspec drafter's held-out answers top-1/2 agreement with the target moved by at
most 0.006 (ARCHITECTURE.md, "Drafts from int8 panels")."""


class PackedDraftNet:
    """DraftNet over specloop's own Llama forward (serving/engine/llama_forward.py): the target's
    decode path, for a drafter of a few layers. Every projection is a packed bf16 panel read by
    the native kernel (norms, activation and residuals inside its calls), attention is the native
    kernel writing the drafter's own cache buffers, and with the native layer stack the layers are
    one call: a day-0 selfspec draft token cost 7.6 ms through the module-by-module path at 2
    threads, against a 13.7 ms target step (ARCHITECTURE.md, "Learned drafts on the target's
    decode path"). The layers a selfspec drafter shares with the target are the target's own
    packed panels where the engine has built them."""

    def __init__(self, model: LlamaForCausalLM, draft_vocab: torch.Tensor | None = None,
                 target: torch.nn.Module | None = None, bf16: bool = True, int8: bool | None = None):
        """``bf16``: pack the bf16 roundings of weights that are not exactly bf16 (half the bytes);
        else fp32 panels for them (the weights exactly). ``int8`` (default: ``DRAFT_INT8`` where
        ``bf16``, i.e. where rounding is allowed): int8 panels for every projection and the head,
        the shared layers included (their own copies)."""
        cfg = model.config
        self.model = model.eval()
        self.vocab_map = None if draft_vocab is None else torch.as_tensor(draft_vocab, dtype=torch.long)
        self.forward = drafter_forward(model, head_rows=self.vocab_map, target=target, bf16=bf16,
                                       int8=DRAFT_INT8 and bf16 if int8 is None else int8)
        self.num_layers = int(cfg.num_hidden_layers)
        self.num_kv_heads = int(cfg.num_key_value_heads)
        self.head_dim = int(self.forward.head_dim)
        self.hidden_size = int(cfg.hidden_size)
        self.dtype = torch.float32
        self.kv_dtype = self.forward.kv_dtype  # the native attention's cache: bf16 on bf16 operands
        self.target_vocab_size = int(model.get_output_embeddings().weight.shape[0])
        f = self.forward
        self.chain = DraftChain.build(f.stack, f.embed, f.rope.table(), f.final_norm, f.lm_head_served,
                                      self.kv_dtype, self.vocab_map)
        """A greedy draft of one request in one native call (kernels/draft_chain.py), where it runs:
        ``LearnedDrafter.propose`` takes it for that case (serving/drafters/chained.py)."""

    @staticmethod
    def supports(model: torch.nn.Module) -> bool:
        """Whether ``model`` can draft through it here: a Llama LM in fp32 on the CPU, with the
        native projection and attention kernels built."""
        head = model.get_output_embeddings().weight
        if not (LlamaForward.supports(model) and head.device.type == "cpu" and head.dtype == torch.float32):
            return False
        return packed_linear.available() and native_attention.available()

    def _forward(self, tokens, positions, cache, mask):
        cols = None
        if isinstance(cache, BatchKV):  # the native attention writes its buffers itself
            b, q = tokens.shape
            first = np.arange(cache.length, cache.length + q, dtype=np.int64)  # numpy: cold caches
            cols = torch.from_numpy(np.tile(first, (b, 1)))  # [B, q]
        return self.forward.hidden(tokens, positions, mask, cache, cols=cols)  # [B, q, H]

    def extend(self, tokens, features, positions, cache, mask):
        return self._forward(tokens, positions, cache, mask)

    def step(self, tokens, hidden, positions, cache, mask):
        return self._forward(tokens, positions, cache, mask)

    def logits(self, hidden):
        return self.forward.head(hidden)  # [B, Vd]


def draft_net(model: LlamaForCausalLM, draft_vocab: torch.Tensor | None = None,
              target: torch.nn.Module | None = None, bf16: bool = True):
    """The DraftNet a standalone-shaped drafter serves with (and the gate times): the packed
    native path where it runs, else the module-by-module one (``bf16``: through bf16 copies)."""
    if PackedDraftNet.supports(model):
        return PackedDraftNet(model, draft_vocab, target=target, bf16=bf16)
    return StandaloneNet(model, draft_vocab, bf16=bf16)


class StandaloneDrafter(LearnedDrafter):
    kind = "standalone"
    source_kind = DrafterKind.STANDALONE

    def __init__(
        self,
        model: LlamaForCausalLM,
        version: str = DAY0_VERSION,
        draft_vocab: torch.Tensor | None = None,
        bf16: bool = True,
        target: torch.nn.Module | None = None,
    ):
        """Drafts through ``draft_net``: the packed native path where it runs (reading the layers
        shared with ``target`` from the target's own panels), else ``StandaloneNet`` (``bf16``:
        through bf16 copies of the weights; the self-speculative subclass shares its first layers
        with the target and keeps them fp32 there)."""
        super().__init__(draft_net(model, draft_vocab, target=target, bf16=bf16), version)
        self.model = model

    def _initial_inputs(self, view: DraftRequestView, features: torch.Tensor | None):
        return view.token_ids, None


class SelfSpecDrafter(StandaloneDrafter):
    """The target's first layers + a trained adapter + its norm and lm_head
    (feedback/drafters/from_target.py): drafted like a standalone LM whose shared layers are the
    target's own modules, reading the lm_head only at the adapter's draft vocabulary."""

    kind = "selfspec"
    source_kind = DrafterKind.SELFSPEC

    def __init__(self, model: LlamaForCausalLM, version: str = DAY0_VERSION,
                 target: torch.nn.Module | None = None):
        # bf16 on the packed path, where the shared layers are the target's panels (exactly bf16)
        # and only the adapter and norm are rounded; fp32 on the module path, where bf16 copies
        # would hang on the target's own modules.
        super().__init__(model, version, draft_vocab=getattr(model, "selfspec_draft_vocab", None),
                         bf16=PackedDraftNet.supports(model), target=target)
