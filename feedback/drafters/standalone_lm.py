"""The standalone drafter: a plain ``transformers.LlamaForCausalLM`` with few layers on the
target's tokenizer (what SGLang's STANDALONE runs); ``StandaloneConfig`` is its serialisable config.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from feedback.drafters.shapes import LlamaShapes


class StandaloneConfig(LlamaShapes):
    """A small Llama causal LM on the target's vocabulary (saved in the artifact's config.json)."""

    vocab_size: int
    num_hidden_layers: int
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    @classmethod
    def for_target(
        cls, target_config: LlamaConfig, num_layers: int = 2, vocab_size: int | None = None
    ):
        tc = target_config
        return cls(
            **LlamaShapes.of(tc),
            vocab_size=int(vocab_size or tc.vocab_size),
            num_hidden_layers=int(num_layers),
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


_SERVED_SHAPE_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                        "head_dim", "num_hidden_layers", "vocab_size", "tie_word_embeddings")


def load_served_standalone(directory, target_model: nn.Module, num_layers: int = 2) -> LlamaForCausalLM:
    """The day-0 standalone draft a server runs from ``directory`` (SGLang's layout: a Hugging Face
    Llama LM on the target's vocabulary), as the trainer's first student: the same weights, so that
    a candidate is judged against what is live, and the shape ``standalone_from_target`` gives
    (SGLang's draft-only swaps keep the served shape). ValueError naming the fields that differ."""
    served = LlamaForCausalLM.from_pretrained(str(directory))
    want = StandaloneConfig.for_target(target_model.config, num_layers=num_layers,
                                       vocab_size=int(target_model.get_output_embeddings().weight.shape[0]))
    have = served.config
    differ = [f"{name} {getattr(have, name, None)} != {getattr(want, name)}" for name in _SERVED_SHAPE_FIELDS
              if getattr(have, name, None) != getattr(want, name)]
    if differ:
        raise ValueError(f"the served day-0 draft {directory} is not the shape the trainer's student "
                         f"exports ({'; '.join(differ)}): serving would refuse every promotion")
    return served.to(target_model.get_output_embeddings().weight.dtype).eval()
