"""Self-speculative drafter: the target's own first layers, a small trainable adapter, its final
norm and LM head (Kangaroo / LayerSkip style).

    tokens -> target embed -> target layers 0..E-1 (frozen, shared) -> adapter layers (trainable)
           -> norm (trainable, starts as the target's) -> target lm_head rows of the draft vocab

Everything frozen is the target's own tensors, shared by reference in memory: the artifact holds
only the ``SelfSpecAdapter`` (adapter decoder layers + norm, a few MB) and the target fingerprint,
so a swap moves a few MB and a drafter cut from another target is refused at load
(feedback/registry/artifact.py). ``assemble`` joins an adapter and a target into a plain
``LlamaForCausalLM`` of E + A layers, which serving drafts with (serving/drafters/standalone.py:
per-request KV caches over all E + A layers) and the trainer distils (trainer/students.py, only the
adapter's parameters trainable).

Day 0: the adapter starts as a copy of target layer E (``adapter_init="next"``: the assembled
drafter is then exactly the target exited early after E + 1 layers) or of its last layer
(``"last"``). ``specloop bench train --student selfspec --exit-layer E`` measures which E pays:
E = 2, 4, 6 and 8 reached the same held-out acceptance after 36 requests at up to 2.8x the draft
cost (ARCHITECTURE.md, thirteenth session), so E = 2 is the default.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import model_validator
from torch import nn
from transformers import LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm

from feedback.drafters.standalone_lm import StandaloneConfig
from feedback.drafters.vocab import checked_vocab_ids


class SelfSpecConfig(StandaloneConfig):
    """A standalone-shaped drafter whose first ``exit_layer`` layers, embeddings and lm_head are the
    target's (``num_hidden_layers`` = exit_layer + adapter layers)."""

    exit_layer: int
    """Target decoder layers shared (0 .. exit_layer - 1)."""
    target_num_layers: int
    draft_vocab_size: int | None = None
    """Rows of the lm_head read when drafting (None: the full vocabulary)."""

    @model_validator(mode="after")
    def _check(self) -> SelfSpecConfig:
        if not 0 <= self.exit_layer <= self.target_num_layers:
            raise ValueError(f"exit_layer {self.exit_layer} outside 0..{self.target_num_layers}")
        if self.num_hidden_layers <= self.exit_layer:
            raise ValueError("a self-speculative drafter needs at least one adapter layer")
        return self

    @property
    def adapter_layers(self) -> int:
        return self.num_hidden_layers - self.exit_layer

    @classmethod
    def for_target(  # type: ignore[override]
        cls,
        target_config,
        exit_layer: int = 2,
        adapter_layers: int = 1,
        vocab_size: int | None = None,
        draft_vocab_size: int | None = None,
    ) -> SelfSpecConfig:
        base = StandaloneConfig.for_target(
            target_config, num_layers=exit_layer + adapter_layers, vocab_size=vocab_size
        )
        return cls(
            **base.model_dump(),
            exit_layer=int(exit_layer),
            target_num_layers=int(target_config.num_hidden_layers),
            draft_vocab_size=draft_vocab_size,
        )


class SelfSpecAdapter(nn.Module):
    """The trainable part, and all an artifact stores: ``layers`` (decoder layers numbered after
    the shared ones), ``norm``, and the ``draft_vocab`` buffer ([Vd] sorted target ids whose lm_head
    rows drafting reads; absent when the draft vocabulary is the target's)."""

    def __init__(self, config: SelfSpecConfig):
        super().__init__()
        self.config = config
        llama = _llama(config)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(llama, config.exit_layer + i) for i in range(config.adapter_layers)
        )
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        vd = config.draft_vocab_size
        self.register_buffer("draft_vocab", None if vd is None else torch.arange(vd))

    def set_draft_vocab(self, ids: torch.Tensor) -> None:
        """[Vd] sorted distinct target ids."""
        check_draft_vocab(self.config, ids)
        self.draft_vocab = torch.as_tensor(ids, dtype=torch.long).clone()


def _llama(config: SelfSpecConfig, attn: str | None = None):
    """LlamaConfig with an attention implementation set (HF picks none for bare modules, and its
    mask code then treats them as non-causal)."""
    llama = config.llama_config()
    llama._attn_implementation = attn or "sdpa"
    return llama


def check_draft_vocab(config: SelfSpecConfig, ids: torch.Tensor | None) -> None:
    """ValueError unless ``ids`` is a valid draft vocabulary for ``config``."""
    if config.draft_vocab_size is None:
        if ids is not None:
            raise ValueError("config has no draft vocabulary but ids were given")
        return
    ids = torch.as_tensor(ids)
    if ids.shape != (config.draft_vocab_size,):
        raise ValueError(f"draft vocab must be {config.draft_vocab_size} integer ids, got {tuple(ids.shape)}")
    checked_vocab_ids(ids, config.vocab_size)


def check_target(config: SelfSpecConfig, target_model: nn.Module) -> None:
    """Refuse a target whose shapes differ from the ones the adapter was cut from."""
    tc = target_model.config
    vocab = int(target_model.get_output_embeddings().weight.shape[0])
    mismatches = {
        name: (want, got)
        for name, want, got in (
            ("num_hidden_layers", config.target_num_layers, int(tc.num_hidden_layers)),
            ("hidden_size", config.hidden_size, int(tc.hidden_size)),
            ("vocab_size", config.vocab_size, vocab),
            ("num_key_value_heads", config.num_key_value_heads, int(tc.num_key_value_heads)),
        )
        if want != got
    }
    if mismatches:
        raise ValueError(f"self-speculative adapter does not fit this target: {mismatches}")


def selfspec_adapter_from_target(
    target_model: nn.Module,
    *,
    exit_layer: int = 2,
    adapter_layers: int = 1,
    adapter_init: Literal["next", "last"] = "next",
    draft_vocab: torch.Tensor | None = None,
) -> SelfSpecAdapter:
    """Day-0 adapter: copies of target layers E.. (``next``) or of its last layers (``last``), and
    the target's final norm. ``draft_vocab``: [Vd] sorted target ids (None: full vocabulary)."""
    draft_vocab_size = None if draft_vocab is None else len(draft_vocab)
    tc = target_model.config
    vocab = int(target_model.get_output_embeddings().weight.shape[0])
    cfg = SelfSpecConfig.for_target(
        tc, exit_layer, adapter_layers, vocab_size=vocab, draft_vocab_size=draft_vocab_size
    )
    n = int(tc.num_hidden_layers)
    if adapter_init == "next":
        sources = range(exit_layer, exit_layer + adapter_layers)
    elif adapter_init == "last":
        sources = range(n - adapter_layers, n)
    else:
        raise ValueError(f"unknown adapter_init {adapter_init!r} (next | last)")
    if min(sources) < 0 or max(sources) >= n:
        raise ValueError(f"target has {n} layers; cannot copy layers {list(sources)}")
    adapter = SelfSpecAdapter(cfg)
    with torch.no_grad():
        for own, src in zip(adapter.layers, sources):
            own.load_state_dict(target_model.model.layers[src].state_dict())
        adapter.norm.load_state_dict(target_model.model.norm.state_dict())
    if draft_vocab is not None:
        adapter.set_draft_vocab(draft_vocab)
    dtype = target_model.get_output_embeddings().weight.dtype
    return adapter.to(dtype).eval()


def assemble(adapter: SelfSpecAdapter, target_model: nn.Module) -> LlamaForCausalLM:
    """A LlamaForCausalLM whose embeddings, first E layers, rotary table and lm_head *are* the
    target's modules (shared, not copied) and whose last layers and norm are the adapter's."""
    cfg = adapter.config
    check_target(cfg, target_model)
    with torch.device("meta"):
        model = LlamaForCausalLM(_llama(cfg, target_model.config._attn_implementation))
    inner, t_inner = model.model, target_model.model
    inner.embed_tokens = t_inner.embed_tokens
    inner.layers = nn.ModuleList([*t_inner.layers[: cfg.exit_layer], *adapter.layers])
    inner.norm = adapter.norm
    inner.rotary_emb = t_inner.rotary_emb
    model.lm_head = target_model.get_output_embeddings()
    model.selfspec_draft_vocab = adapter.draft_vocab  # [Vd] lm_head rows drafting reads, or None
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"assemble left meta tensors: {left}")
    return model.eval()


def shared_parameters(model: LlamaForCausalLM, exit_layer: int) -> list[nn.Parameter]:
    """The target's parameters inside an assembled drafter (to freeze when training)."""
    inner = model.model
    mods = [inner.embed_tokens, model.lm_head, *inner.layers[:exit_layer]]
    return [p for m in mods for p in m.parameters()]


def adapter_of(model: LlamaForCausalLM, config: SelfSpecConfig) -> SelfSpecAdapter:
    """The adapter view of an assembled drafter (shares its tensors; for saving an artifact)."""
    adapter = SelfSpecAdapter.__new__(SelfSpecAdapter)
    nn.Module.__init__(adapter)
    adapter.config = config
    adapter.layers = nn.ModuleList(model.model.layers[config.exit_layer :])
    adapter.norm = model.model.norm
    vocab = getattr(model, "selfspec_draft_vocab", None)
    adapter.register_buffer("draft_vocab", None if vocab is None else vocab.clone())
    return adapter
