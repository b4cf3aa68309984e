"""Valid random TraceRecords for tests (no model needed): tests import it as ``trace_samples``."""

from __future__ import annotations

import uuid

import numpy as np

from feedback.bus.trace import DrafterKind, StepArrays, TraceRecord
from feedback.target.fingerprint import TargetFingerprint

TEST_TARGET = TargetFingerprint(model_id="test-target", tokenizer_hash="0" * 16, vocab_size=49_152)


def make_trace(
    num_steps: int = 16,
    k: int = 4,
    topk: int = 8,
    with_hidden: bool = False,
    seed: int = 0,
    *,
    tenant: str = "default",
    prompt_len: int = 12,
    hidden_dim: int = 32,
    drafter_version: str = "v0",
    request_id: str | None = None,
    target: TargetFingerprint = TEST_TARGET,
) -> TraceRecord:
    """A record shaped like the engine's: accepted drafts match the output, the rest is padding.

    Steps draft 0..k tokens and accept 0..drafted of them; rows past ``num_drafted`` in the
    target top-k arrays are -1 padded, like a step that drafted fewer than k tokens.
    """
    rng = np.random.default_rng(seed)
    vocab = target.vocab_size
    num_drafted = rng.integers(0, k + 1, num_steps).astype(np.int16)
    num_accepted = rng.integers(0, num_drafted.astype(np.int64) + 1).astype(np.int16)
    emitted = num_accepted.astype(np.int64) + 1
    positions = (np.cumsum(emitted) - emitted).astype(np.int32)
    output_ids = rng.integers(0, vocab, int(emitted.sum())).astype(np.int32)

    draft_ids = np.full((num_steps, k), -1, np.int32)
    draft_probs = np.zeros((num_steps, k), np.float32)
    topk_ids = np.full((num_steps, k + 1, topk), -1, np.int32)
    topk_logprobs = np.full((num_steps, k + 1, topk), -np.inf, np.float16)
    for s in range(num_steps):
        d, a, p = int(num_drafted[s]), int(num_accepted[s]), int(positions[s])
        draft_ids[s, :d] = rng.integers(0, vocab, d)
        draft_ids[s, :a] = output_ids[p:p + a]
        draft_probs[s, :d] = rng.uniform(0.05, 1.0, d)
        topk_ids[s, :d + 1] = rng.integers(0, vocab, (d + 1, topk))
        logits = np.sort(rng.normal(0.0, 3.0, (d + 1, topk)))[:, ::-1]
        topk_logprobs[s, :d + 1] = logits - np.log(np.exp(logits).sum(-1, keepdims=True) + 1.0)

    prompt_ids = rng.integers(0, vocab, prompt_len).astype(np.int32)
    hidden = None
    if with_hidden:
        n = prompt_len + len(output_ids)
        hidden = rng.integers(0, 2**16, (n, hidden_dim), dtype=np.uint16)
    return TraceRecord(
        request_id=request_id or uuid.UUID(int=int(rng.integers(0, 2**63))).hex,
        tenant=tenant,
        domain="chat",
        created_at=1_700_000_000.0 + seed,
        finished_at=1_700_000_001.5 + seed,
        target=target,
        drafter_kind="suffix",
        drafter_version=drafter_version,
        temperature=0.7,
        top_p=0.95,
        top_k=0,
        finish_reason="length",
        prompt_ids=prompt_ids,
        output_ids=output_ids,
        steps=StepArrays(
            positions=positions,
            num_drafted=num_drafted,
            num_accepted=num_accepted,
            source=np.where(num_drafted > 0, DrafterKind.SUFFIX, DrafterKind.NONE).astype(np.uint8),
            draft_ids=draft_ids,
            draft_probs=draft_probs,
            target_topk_ids=topk_ids,
            target_topk_logprobs=topk_logprobs,
        ),
        hidden_states=hidden,
        hidden_layers=(29,) if with_hidden else (),
    )


def assert_same_trace(a: TraceRecord, b: TraceRecord) -> None:
    """Field-by-field equality (pydantic's == does not compare numpy arrays)."""
    for name in TraceRecord.model_fields:
        if name in ("steps", "prompt_ids", "output_ids", "hidden_states"):
            continue
        assert getattr(a, name) == getattr(b, name), name
    np.testing.assert_array_equal(a.prompt_ids, b.prompt_ids, strict=True)
    np.testing.assert_array_equal(a.output_ids, b.output_ids, strict=True)
    for name in StepArrays.model_fields:
        x, y = getattr(a.steps, name), getattr(b.steps, name)
        if x is None or y is None:
            assert x is None and y is None, name
            continue
        np.testing.assert_array_equal(x, y, err_msg=name, strict=True)
    if a.hidden_states is None or b.hidden_states is None:
        assert a.hidden_states is None and b.hidden_states is None
    else:
        np.testing.assert_array_equal(a.hidden_states, b.hidden_states, strict=True)


def _with_steps(record: TraceRecord, **arrays) -> TraceRecord:
    """``record`` with some step arrays replaced, unvalidated (what a buggy producer could encode)."""
    return record.model_copy(update={"steps": record.steps.model_copy(update=arrays)})


def poisoned_trace(name: str, **trace_kw) -> TraceRecord:
    """A record that encodes (the codec does not validate on the way out) but must not decode:
    well framed, but its content would poison or crash training. ``POISONED`` lists the names;
    ``trace_kw`` go to ``make_trace``."""
    record = make_trace(**{"num_steps": 8, "k": 4, "topk": 6, "seed": 21, **trace_kw})
    s = record.steps
    drafting = int(np.argmax(s.num_drafted > 0))  # a step that drafted something
    if name == "nan_logprob":
        lp = s.target_topk_logprobs.copy()
        lp[drafting, 0, 0] = np.nan
        return _with_steps(record, target_topk_logprobs=lp)
    if name == "posinf_logprob":
        lp = s.target_topk_logprobs.copy()
        lp[drafting, 0, 0] = np.inf
        return _with_steps(record, target_topk_logprobs=lp)
    if name == "misaligned_positions":  # in range, but not where each step's tokens are
        return _with_steps(record, positions=np.full_like(s.positions, len(record.output_ids) - 1))
    if name == "padding_as_drafted_id":  # -1 is padding: a drafted token must be a real id
        ids = s.draft_ids.copy()
        ids[drafting, : int(s.num_drafted[drafting])] = -1
        return _with_steps(record, draft_ids=ids)
    if name == "output_2d":
        return record.model_copy(update={"output_ids": record.output_ids.reshape(-1, 1)})
    if name == "prompt_2d":
        return record.model_copy(update={"prompt_ids": record.prompt_ids.reshape(-1, 1)})
    if name == "positions_2d":
        return _with_steps(record, positions=s.positions.reshape(-1, 1))
    if name == "empty_prompt":  # the first step's rows would have no context at all
        return record.model_copy(update={"prompt_ids": record.prompt_ids[:0]})
    if name == "nan_finished_at":  # never expires: retention would keep it forever
        return record.model_copy(update={"finished_at": float("nan")})
    raise KeyError(name)


POISONED = ("nan_logprob", "posinf_logprob", "misaligned_positions",
            "padding_as_drafted_id", "output_2d", "prompt_2d", "positions_2d", "empty_prompt",
            "nan_finished_at")
