"""EAGLE drafter: an EagleHead on the target's hidden states, drafting k tokens per verify.

Draft position t pairs the target feature f_t with token t+1. A request's history x_0..x_n comes
with features for x_0..x_{n-1} (what the target has in its KV cache), i.e. pairs (f_t, x_{t+1}) for
t < n; the last pair's output gives the first draft token. Draft steps then feed the head's own
output hidden state and its own token. After a verify step the engine sends the committed tokens
a_1..a_m with the features of the inputs that produced them (x_n, a_1..a_{m-1}): m new real pairs,
committed at the next propose (the speculative positions are discarded).
"""

from __future__ import annotations

import torch

from feedback.bus.trace import DrafterKind
from feedback.drafters.eagle_head import EagleHead
from feedback.registry.artifact_keys import DAY0_VERSION
from serving.drafters.base import DraftRequestView
from serving.drafters.draft_kv import RowState
from serving.drafters.learned import LearnedDrafter


class EagleNet:
    """DraftNet adapter over an EagleHead."""

    def __init__(self, head: EagleHead):
        c = head.config
        self.head = head.eval()
        self.num_layers = 1
        self.num_kv_heads = c.num_key_value_heads
        self.head_dim = c.head_dim
        self.hidden_size = c.hidden_size
        self.feature_size = c.feature_size
        self.dtype = head.fc.weight.dtype
        self.kv_dtype = self.dtype
        self.target_vocab_size = c.target_vocab_size
        self.vocab_map = head.draft_vocab()

    def extend(self, tokens, features, positions, cache, mask):
        return self.head(
            tokens, features=features, position_ids=positions, cache=cache, attn_mask=mask
        )

    def step(self, tokens, hidden, positions, cache, mask):
        return self.head(tokens, hidden, position_ids=positions, cache=cache, attn_mask=mask)

    def logits(self, hidden):
        return self.head.compute_logits(hidden)


class EagleDrafter(LearnedDrafter):
    kind = "eagle"
    source_kind = DrafterKind.EAGLE

    def __init__(self, head: EagleHead, version: str = DAY0_VERSION):
        if head.embed_weight is None:
            raise ValueError("EagleHead needs the target's embeddings: head.attach_embeddings(...)")
        super().__init__(EagleNet(head), version)
        self.head = head
        self.feature_layers = tuple(head.config.feature_layers)

    def _initial_inputs(self, view: DraftRequestView, features: torch.Tensor | None):
        n = len(view.token_ids) - 1
        return view.token_ids[1:], self._check_features(features, n)

    def _check_features(self, features: torch.Tensor | None, n: int) -> torch.Tensor:
        if features is None:
            raise ValueError(f"eagle drafter needs target features (layers {self.feature_layers})")
        if features.dim() != 2 or features.shape != (n, self.net.feature_size):
            raise ValueError(
                f"eagle features must be [{n}, {self.net.feature_size}] "
                f"(layers {self.feature_layers} concatenated), got {tuple(features.shape)}"
            )
        return features

    def _pad_features(self, rows: list[RowState], block: int) -> torch.Tensor:
        feats = torch.zeros(
            len(rows), block, self.net.feature_size, dtype=self.net.dtype
        )  # [B, M, F]
        for i, s in enumerate(rows):
            if s.pending_features:
                f = (
                    torch.cat(s.pending_features)
                    if len(s.pending_features) > 1
                    else s.pending_features[0]
                )
                feats[i, : f.shape[0]] = f
        return feats
