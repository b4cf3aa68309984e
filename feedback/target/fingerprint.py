"""Target fingerprint: which target model (and tokenizer) a drafter or trace belongs to.

A drafter trained against one target is useless (or harmful) against another, and a trace's token
ids mean nothing under another tokenizer. Every drafter artifact and every trace carries this.
"""

from __future__ import annotations

import hashlib
import json

from pydantic import BaseModel, ConfigDict


class TargetFingerprint(BaseModel):
    model_config = ConfigDict(frozen=True)

    model_id: str
    """Human-readable model id, e.g. ``SmolLM2-135M-Instruct``."""
    tokenizer_hash: str
    """sha256 (hex, first 16 chars) of the tokenizer's vocabulary and special tokens."""
    vocab_size: int
    """Size of the target's output layer (may exceed the tokenizer's vocabulary)."""

    def key(self) -> str:
        """Short stable string, usable as an experiment or file name."""
        return f"{self.model_id}-{self.tokenizer_hash[:8]}"

    def matches(self, other: TargetFingerprint) -> bool:
        return (
            self.tokenizer_hash == other.tokenizer_hash
            and self.vocab_size == other.vocab_size
            and self.model_id == other.model_id
        )


def tokenizer_hash(tokenizer) -> str:
    """Hash a Hugging Face tokenizer's vocabulary (token -> id) and special tokens."""
    vocab = tokenizer.get_vocab()
    payload = {
        "vocab": sorted(vocab.items(), key=lambda kv: kv[1]),
        "special": sorted(str(t) for t in getattr(tokenizer, "all_special_tokens", [])),
    }
    blob = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def fingerprint_for(model_id: str, tokenizer, vocab_size: int) -> TargetFingerprint:
    """The one way a target is fingerprinted (serving, SGLang metadata and the trainer)."""
    return TargetFingerprint(model_id=model_id, tokenizer_hash=tokenizer_hash(tokenizer), vocab_size=vocab_size)
