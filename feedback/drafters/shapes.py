"""The Llama shapes every learned drafter's config carries (saved in its artifact's config.json)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from feedback.drafters.ops import _rope_parameters


class LlamaShapes(BaseModel):
    """Decoder-layer shapes and rope settings shared by the standalone and EAGLE drafters' configs."""

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

    @staticmethod
    def of(target_config) -> dict:
        """These fields read from a target's (Hugging Face) Llama config, as keyword arguments."""
        tc = target_config
        return {
            "hidden_size": int(tc.hidden_size),
            "intermediate_size": int(tc.intermediate_size),
            "num_attention_heads": int(tc.num_attention_heads),
            "num_key_value_heads": int(tc.num_key_value_heads),
            "head_dim": int(getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads),
            "rms_norm_eps": float(tc.rms_norm_eps),
            "hidden_act": str(tc.hidden_act),
            "rope_parameters": _rope_parameters(tc),
            "max_position_embeddings": int(tc.max_position_embeddings),
        }
