"""Offline training: the static drafter a user would train before deploying.

``specloop train --offline PROMPTS.jsonl`` generates the target's own greedy responses to the
prompts, turns each into a trace (one verify step per output token, no drafts: the target's top-k
at every output position, exactly what served traces carry on their accepted path), and distils
a drafter from them with the online trainer's code (ReplayBuffer, Distiller with held-out early
stopping, artifact export), then saves it (and registers it in MLflow when a tracking URI is
given). The trainer does not import serving, so its own generator is Hugging Face's ``generate`` plus
one teacher-forced forward for the top-k (greedy: identical tokens); the ``specloop`` CLI installs
serving's engine instead (infra/offline_generation.py), several times faster.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from feedback.bus.trace import StepArrays, TraceRecord
from feedback.jsonl import iter_jsonl
from feedback.registry.artifact_keys import EXTRA_HELDOUT_ACCEPTANCE
from feedback.target.fingerprint import TargetFingerprint
from kernels.topk_logprobs import topk_logprobs


@dataclass
class OfflinePrompt:
    ids: list[int]
    domain: str | None = None


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of ``messages`` in the target's chat template, ready for the assistant's turn."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids)


def read_prompts(path: str | Path, tokenizer) -> list[OfflinePrompt]:
    """JSONL rows with ``messages`` (chat, the target's template) or ``prompt`` (raw text), and an
    optional ``domain``. A bad row raises ValueError naming its line."""
    out = []
    for n, row in iter_jsonl(path):
        if not isinstance(row, dict) or ("messages" in row) == ("prompt" in row):
            raise ValueError(f"{path}:{n}: needs exactly one of 'messages' or 'prompt'")
        ids = chat_ids(tokenizer, row["messages"]) if "messages" in row else tokenizer.encode(str(row["prompt"]))
        out.append(OfflinePrompt(list(ids), row.get("domain")))
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


def _undrafted_trace(fingerprint: TargetFingerprint, prompt: list[int], output: list[int],
                     top_ids: torch.Tensor, top_logprobs: torch.Tensor, *, domain: str | None,
                     tenant: str, request_id: str) -> TraceRecord:
    """One undrafted verify step per output token; ``top_*``: [len(output), topk] target top-k."""
    n = len(output)
    steps = StepArrays(
        positions=np.arange(n, dtype=np.int32),
        num_drafted=np.zeros(n, dtype=np.int32),
        num_accepted=np.zeros(n, dtype=np.int32),
        source=np.zeros(n, dtype=np.uint8),
        draft_ids=np.zeros((n, 0), dtype=np.int32),
        draft_probs=np.zeros((n, 0), dtype=np.float32),
        target_topk_ids=top_ids.numpy().astype(np.int32)[:, None],  # [T, 1, topk]
        target_topk_logprobs=top_logprobs.numpy().astype(np.float32)[:, None],
    )
    return TraceRecord(request_id=request_id, tenant=tenant, domain=domain,
                       target=fingerprint, drafter_kind="none", drafter_version="offline",
                       prompt_ids=np.asarray(prompt, dtype=np.int32),
                       output_ids=np.asarray(output, dtype=np.int32), steps=steps)


@torch.inference_mode()
def teacher_trace(model, fingerprint: TargetFingerprint, prompt: list[int], output: list[int], *,
                  topk: int = 20, domain: str | None = None, tenant: str = "default") -> TraceRecord:
    """A trace of ``output`` as the target's response to ``prompt``: one undrafted verify step per
    output token, with the target's top-``topk`` (ids, logprobs) at that position."""
    ids = torch.tensor([prompt + output])
    logits = model(ids).logits[0, len(prompt) - 1 : -1]  # [T, V]: predicts each output token
    top_ids, top_logprobs = topk_logprobs(logits.float().contiguous(), topk)  # [T, topk] each
    return _undrafted_trace(fingerprint, prompt, output, top_ids, top_logprobs, domain=domain,
                            tenant=tenant, request_id=f"offline-{uuid.uuid4().hex[:12]}")


@torch.inference_mode()
def corpus_traces(model, fingerprint: TargetFingerprint, chunks, *, topk: int = 20, batch_size: int = 4,
                  tenant: str = "default", progress=None) -> list[TraceRecord]:
    """Teacher-forced traces of text chunks (trainer/corpus.py ``CorpusChunk``): the first token is
    the prompt, every later position a row with the target's top-``topk``. Chunks of one length go
    through the target ``batch_size`` at a time. ``progress(n)`` after each batch."""
    out: list[TraceRecord] = []
    by_len: dict[int, list] = {}
    for c in chunks:
        if len(c.ids) >= 2:
            by_len.setdefault(len(c.ids), []).append(c)
    for group in by_len.values():
        for i in range(0, len(group), batch_size):
            batch = group[i : i + batch_size]
            ids = torch.tensor([c.ids for c in batch])  # [B, T]
            logits = model(ids).logits.float()  # [B, T, V]
            rows, length, vocab = logits.shape
            # every position, the last included (one row in T, cheaper than copying the others out)
            flat = logits.reshape(rows * length, vocab).contiguous()  # [B*T, V]
            top_ids, top_logprobs = topk_logprobs(flat, topk)  # [B*T, topk] each
            top_ids = top_ids.reshape(rows, length, -1)[:, :-1]  # [B, T-1, topk]
            top_logprobs = top_logprobs.reshape(rows, length, -1)[:, :-1]
            for b, c in enumerate(batch):
                out.append(_undrafted_trace(fingerprint, c.ids[:1], c.ids[1:], top_ids[b], top_logprobs[b],
                                            domain=c.domain, tenant=tenant,
                                            request_id=f"corpus-{uuid.uuid4().hex[:12]}"))
            if progress is not None:
                progress(len(batch))
    return out


@torch.inference_mode()
def generate_traces(model, tokenizer, fingerprint: TargetFingerprint, prompts: list[OfflinePrompt], *,
                    max_new_tokens: int = 64, batch_size: int = 8, topk: int = 20,
                    tenant: str = "default") -> list[TraceRecord]:
    """Greedy responses (batched, left-padded), then one teacher-forced trace per prompt."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    out: list[TraceRecord] = []
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i : i + batch_size]
        width = max(len(p.ids) for p in batch)
        ids = torch.full((len(batch), width), pad)
        mask = torch.zeros_like(ids)
        for j, p in enumerate(batch):
            ids[j, width - len(p.ids):] = torch.tensor(p.ids)
            mask[j, width - len(p.ids):] = 1
        gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=pad)
        for j, p in enumerate(batch):
            response = gen[j, width:].tolist()
            eos = tokenizer.eos_token_id
            if eos in response:
                response = response[: response.index(eos) + 1]
            if response:
                out.append(teacher_trace(model, fingerprint, p.ids, response, topk=topk,
                                         domain=p.domain, tenant=tenant))
    return out


ResponseGenerator = Callable[..., list[TraceRecord]]
"""``generate(prompts: list[OfflinePrompt], *, max_new_tokens, topk, tenant)``: one trace of the
target's greedy response per prompt, in order (``hf_generator`` or infra's ``engine_generator``)."""


def hf_generator(model, tokenizer, fingerprint: TargetFingerprint) -> ResponseGenerator:
    """``generate_traces`` on a Hugging Face ``model``: the trainer's own generator."""

    def generate(prompts: list[OfflinePrompt], *, max_new_tokens: int, topk: int, tenant: str):
        return generate_traces(model, tokenizer, fingerprint, prompts, max_new_tokens=max_new_tokens,
                               topk=topk, tenant=tenant)

    return generate


def train_offline(student, records: list[TraceRecord], fingerprint: TargetFingerprint, *,
                  heldout_fraction: float = 0.15, max_steps: int = 400, k: int = 4, distill=None,
                  seed: int = 0) -> dict:
    """Distil ``student`` on ``records`` (a held-out share picks the best weights, as online)."""
    from trainer.distill import DistillConfig, Distiller
    from trainer.replay import ReplayBuffer

    rng = np.random.default_rng(seed)
    order = rng.permutation(len(records))
    n_held = max(1, round(len(records) * heldout_fraction)) if len(records) > 1 else 0
    replay = ReplayBuffer(heldout_size=max(n_held, 1), fingerprint=fingerprint, half_life=1e12)  # no recency
    for i, idx in enumerate(order):
        replay.add(records[idx], heldout=i < n_held)
    t0 = time.perf_counter()
    res = Distiller(student, distill or DistillConfig()).fit(replay, max_steps, k=k)
    return {"traces": len(records), "heldout_traces": n_held, "train_steps": res.steps,
            "best_step": res.best_step, EXTRA_HELDOUT_ACCEPTANCE: res.best_acceptance,
            "stopped_early": res.stopped_early, "train_s": time.perf_counter() - t0}


def _cached(cache_dir: str | Path | None, name: str, key: bytes, make) -> list[TraceRecord]:
    """``make()``'s traces, kept in ``cache_dir`` as ``{name}-{hash of key}.traces`` (None: no
    cache): teacher-forcing or generating thousands of tokens takes minutes on a CPU, and a second
    run reads them back."""
    import hashlib

    from feedback.bus.trace_file import load_traces, save_traces

    if cache_dir is None:
        return make()
    path = Path(cache_dir) / f"{name}-{hashlib.sha256(key).hexdigest()[:20]}.traces"
    if path.exists():
        return load_traces(path)
    records = make()
    save_traces(records, path)
    return records


def cached_corpus_traces(model, fingerprint: TargetFingerprint, chunks, cache_dir: str | Path | None, *,
                         topk: int = 20, tenant: str = "default", progress=None) -> list[TraceRecord]:
    """``corpus_traces``, kept in ``cache_dir`` under a key of the target and the chunks' token ids."""
    key = [f"{fingerprint.key()}|{topk}|{tenant}".encode()]
    key += [np.asarray(c.ids, dtype=np.int32).tobytes() + c.domain.encode() + b"|" for c in chunks]
    return _cached(cache_dir, "corpus", b"".join(key),
                   lambda: corpus_traces(model, fingerprint, chunks, topk=topk, tenant=tenant, progress=progress))


def cached_generated_traces(generate: ResponseGenerator, fingerprint: TargetFingerprint,
                            prompts: list[OfflinePrompt], cache_dir: str | Path | None, *,
                            max_new_tokens: int = 64, topk: int = 20, tenant: str = "default") -> list[TraceRecord]:
    """``generate``'s traces, kept in ``cache_dir`` under a key of the target, the prompts' token
    ids and domains, and the response length (either generator's: greedy, the same tokens)."""
    key = [f"{fingerprint.key()}|{topk}|{tenant}|{max_new_tokens}".encode()]
    key += [np.asarray(p.ids, dtype=np.int32).tobytes() + str(p.domain).encode() + b"|" for p in prompts]
    return _cached(cache_dir, "responses", b"".join(key),
                   lambda: generate(prompts, max_new_tokens=max_new_tokens, topk=topk, tenant=tenant))
