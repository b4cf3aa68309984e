"""The Llama shapes every learned drafter's config carries (saved in its artifact's config.json)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from feedback.drafters.ops import _rope_parameters


class LlamaShapes(BaseModel):
    """Decoder-layer shapes and rope settings shared by the standalone and EAGLE drafters' configs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Checked here, so that an artifact whose config no model can run is refused when it is read
    # (DrafterArtifactError), not when a layer divides by 0 heads or normalises with eps <= 0.
    hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    rms_norm_eps: float = Field(1e-5, gt=0.0, allow_inf_nan=False)
    hidden_act: str = "silu"
    rope_parameters: dict = Field(
        default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0}
    )
    max_position_embeddings: int = Field(8192, gt=0)

    @model_validator(mode="after")
    def _heads_share_kv_evenly(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        return self

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
