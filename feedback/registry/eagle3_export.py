"""Export an EagleHead to SGLang's EAGLE3 draft checkpoint layout (``LlamaForCausalLMEagle3``).

SGLang (python/sglang/srt/models/llama_eagle3.py) loads a directory with a Llama-style config.json
plus ``draft_vocab_size``/``target_hidden_size``/``eagle_config`` and these tensors (the loader
prefixes ``model.`` itself and stacks q/k/v and gate/up):

    fc.weight                                   [H, 3 * H_target]
    midlayer.input_layernorm.weight             [H]        (on the token embedding)
    midlayer.hidden_norm.weight                 [H]        (on the fed hidden state)
    midlayer.self_attn.{q,k,v}_proj.weight      [heads * head_dim, 2H]
    midlayer.self_attn.o_proj.weight            [H, heads * head_dim]
    midlayer.post_attention_layernorm.weight    [H]
    midlayer.mlp.{gate,up}_proj.weight          [I, H];  midlayer.mlp.down_proj.weight [H, I]
    norm.weight                                 [H]
    lm_head.weight                              [Vd, H]
    d2t                                         [Vd] int64: target_id = draft_id + d2t[draft_id]
    t2d                                         [V] bool
    (embed_tokens.weight [V, H] optional: without it SGLang shares the target's embedding)

EagleHead's own parameter names are these already, so the export is a copy plus config.json.
Feature layers: EagleHead stores HF ``hidden_states`` indices i (the input of decoder layer i);
SGLang captures the input of layer ``id + 1`` for each ``eagle_aux_hidden_state_layer_ids`` id,
so the config carries ``i - 1``. SGLang's fc always reads three layers.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from feedback.drafters.eagle_head import EagleHead

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"


def eagle3_config(head: EagleHead, *, bos_token_id: int | None = None, eos_token_id=None) -> dict:
    """config.json contents for SGLang's EAGLE3 loader."""
    c = head.config
    if len(c.feature_layers) != 3:
        raise ValueError(
            f"SGLang's EAGLE3 head fuses exactly 3 target layers, this head uses {c.feature_layers}"
        )
    if min(c.feature_layers) < 1:
        raise ValueError("feature layer 0 (the embedding output) has no SGLang capture id")
    rope = dict(c.rope_parameters)
    dtype = str(head.lm_head.weight.dtype).removeprefix("torch.")
    return {
        "architectures": [EAGLE3_ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": c.hidden_act,
        "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position_embeddings,
        "rope_theta": float(rope.get("rope_theta", 10000.0)),
        "rope_scaling": None if rope.get("rope_type", "default") == "default" else rope,
        "rope_parameters": rope,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": c.target_vocab_size,
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": dtype,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": [i - 1 for i in c.feature_layers],
            "use_aux_hidden_state": True,
        },
    }


def eagle3_state(
    head: EagleHead, *, include_embeddings: bool = False, dtype: torch.dtype | None = None
):
    """Tensors under SGLang's names (d2t int64, t2d bool; floating tensors cast to ``dtype``)."""
    state = {}
    for name, t in head.state_dict().items():
        t = t.detach().cpu()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        state[name] = t.contiguous()
    state["d2t"] = state["d2t"].to(torch.int64)
    state["t2d"] = state["t2d"].to(torch.bool)
    if include_embeddings:
        if head.embed_weight is None:
            raise ValueError("include_embeddings: the head has no attached embedding table")
        emb = head.embed_weight.detach().cpu()
        state["embed_tokens.weight"] = (emb.to(dtype) if dtype is not None else emb).contiguous()
    return state


def export_eagle3(
    head: EagleHead,
    out_dir: str | Path,
    *,
    include_embeddings: bool = False,
    dtype: torch.dtype | None = None,
    bos_token_id: int | None = None,
    eos_token_id=None,
) -> Path:
    """Write ``config.json`` + ``model.safetensors`` for ``--speculative-draft-model-path``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = eagle3_config(head, bos_token_id=bos_token_id, eos_token_id=eos_token_id)
    state = eagle3_state(head, include_embeddings=include_embeddings, dtype=dtype)
    if dtype is not None:
        config["torch_dtype"] = str(dtype).removeprefix("torch.")
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
