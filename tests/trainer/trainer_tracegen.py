"""Synthetic traces for trainer tests: a bigram "target" per domain and a weak fixed drafter.

The target's next-token distribution depends only on the last token (a fixed random table per
domain), so it is cheap to evaluate on any context, including discarded branches, and a tiny
student can learn it. Outputs are the target's greedy tokens; the drafter proposes a fixed
(wrong most of the time) chain so traces contain rejections and discarded branches.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from feedback.bus.trace import DrafterKind, StepArrays, TraceRecord
from feedback.target.fingerprint import TargetFingerprint

NOT_SUFFIX_TEXT = """Tests that check the learned drafter's promotion gate it alone (hybrid=False):
serving's hybrid rule weighs the suffix drafter's confidences, which are calibrated on SmolLM2 text
and do not describe these synthetic traces, so inside the hybrid the outcome would test that
calibration rather than the trainer."""
VOCAB = 48
TOPK = 8
FP = TargetFingerprint(model_id="bigram-test", tokenizer_hash="0" * 16, vocab_size=VOCAB)
_ids = itertools.count()


def bigram_table(domain: str, sharpness: float = 4.0) -> np.ndarray:
    """[V, V] log-probabilities: row = last token."""
    rng = np.random.default_rng(abs(hash(domain)) % 2**32 if domain not in ("a", "b") else ord(domain))
    logits = rng.normal(size=(VOCAB, VOCAB)) * sharpness
    return logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)


def make_trace(domain: str = "a", *, prompt_len: int = 6, out_len: int = 24, k: int = 3, seed: int | None = None,
               tenant: str = "default", hidden: int = 0, request_id: str | None = None) -> TraceRecord:
    table = bigram_table(domain)
    rng = np.random.default_rng(seed if seed is not None else next(_ids))
    prompt = rng.integers(0, VOCAB, size=prompt_len)
    ctx = list(prompt)
    steps = {"pos": [], "nd": [], "na": [], "ids": [], "probs": [], "tid": [], "tlp": []}
    out: list[int] = []
    while len(out) < out_len:
        draft = rng.integers(0, VOCAB, size=k)
        # make the first draft token right half the time so accepts happen
        if rng.random() < 0.5:
            draft[0] = int(table[ctx[-1]].argmax())
        na, branch = 0, list(ctx)
        tid = np.full((k + 1, TOPK), -1, dtype=np.int32)
        tlp = np.zeros((k + 1, TOPK), dtype=np.float16)
        for j in range(k + 1):
            row = table[branch[-1]]
            top = np.argsort(-row)[:TOPK]
            tid[j], tlp[j] = top, row[top]
            if j < k:
                branch.append(int(draft[j]))
        greedy_ok = True
        emitted = []
        for j in range(k):
            want = int(tid[j, 0])
            if greedy_ok and int(draft[j]) == want:
                na += 1
                emitted.append(want)
            else:
                greedy_ok = False
        emitted.append(int(tid[na, 0]))
        steps["pos"].append(len(out)); steps["nd"].append(k); steps["na"].append(na)
        steps["ids"].append(draft.astype(np.int32)); steps["probs"].append(np.ones(k, np.float32))
        steps["tid"].append(tid); steps["tlp"].append(tlp)
        out.extend(emitted)
        ctx.extend(emitted)
    st = StepArrays(
        positions=np.array(steps["pos"], np.int32), num_drafted=np.array(steps["nd"], np.int16),
        num_accepted=np.array(steps["na"], np.int16),
        source=np.full(len(steps["pos"]), DrafterKind.SUFFIX, np.uint8),
        draft_ids=np.stack(steps["ids"]), draft_probs=np.stack(steps["probs"]),
        target_topk_ids=np.stack(steps["tid"]), target_topk_logprobs=np.stack(steps["tlp"]),
    )
    hs = None
    if hidden:
        n = prompt_len + len(out)
        feats = torch.randn(n, hidden, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        hs = feats.view(torch.int16).numpy().view(np.uint16)
    return TraceRecord(
        request_id=request_id or f"req-{domain}-{rng.integers(1 << 62)}", tenant=tenant, domain=domain,
        target=FP, drafter_kind="suffix", drafter_version="day0",
        prompt_ids=prompt.astype(np.int32), output_ids=np.array(out, np.int32), steps=st, hidden_states=hs,
    )


def tiny_lm(vocab: int = VOCAB, hidden: int = 32, seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(cfg)
