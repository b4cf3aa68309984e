"""``bench engine``'s prefill figures: what TorchEngine's prefix cache saves on a stream of real
prompts (serving/engine/prefix_cache.py), measured against the same prefill without it, alternately
(ABBA), in one run."""

from __future__ import annotations

import statistics
import time

import torch


def prefix_cache_figures(target, streams: dict[str, list[list[int]]], cache_tokens: int = 2048) -> dict:
    """Per named stream of prompts (token ids, in serving order): the prompt tokens the prefix cache
    held (``hit_fraction``), the mean prefill time with and without it and their ratio, and
    whether every prefill from cached blocks left bit for bit the cache of a full one."""
    from serving.engine.model_runner import ModelRunner

    out = {}
    for name, prompts in streams.items():
        cached = ModelRunner(target.model, target.device, prefix_cache_tokens=cache_tokens)
        plain = ModelRunner(target.model, target.device)
        ms = {"cached": [], "plain": []}
        identical = True
        with torch.inference_mode():
            for i, prompt in enumerate(prompts):
                order = (("cached", cached), ("plain", plain))
                caches = {}
                for label, runner in order if i % 2 == 0 else order[::-1]:
                    t0 = time.perf_counter()
                    caches[label], _ = runner.prefill(prompt)
                    ms[label].append(1000 * (time.perf_counter() - t0))
                n = len(prompt) - 1
                a, b = caches["cached"], caches["plain"]
                identical &= all(torch.equal(a.keys[layer][:, :, :n], b.keys[layer][:, :, :n])
                                 and torch.equal(a.values[layer][:, :, :n], b.values[layer][:, :, :n])
                                 for layer in range(a.num_layers))
        hits = cached.prefix_cache
        mean = {label: statistics.fmean(v) for label, v in ms.items()}
        out[name] = {
            "prompts": len(prompts),
            "prompt_tokens_mean": round(statistics.fmean(len(p) for p in prompts), 1),
            "hit_fraction": round(hits.hit_tokens / max(1, hits.hit_tokens + hits.prefilled_tokens), 3),
            "prefill_ms_cached": round(mean["cached"], 1),
            "prefill_ms_plain": round(mean["plain"], 1),
            "speedup": round(mean["plain"] / mean["cached"], 3),
            "bit_identical": identical,
        }
    return out
