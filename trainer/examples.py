"""TraceRecords -> training examples.

One trace gives one *main* sequence (prompt + output: the accepted path) and one *branch* sequence per
verify step that had a rejection (prompt + output[:pos] + draft_ids[:num_drafted]: the discarded
branch, whose target distributions the verify step computed anyway).

Each sequence lists the rows where the target's top-k is known, by ``ctx_len``: row r is the target's
distribution for the token that follows ``tokens[:ctx_len[r]]``, so a causal student reads its
logits at index ``ctx_len[r] - 1``. Accepted-path rows of a step whose drafted token was rejected
also carry that ``rejected_id`` (negative feedback for the discard loss).

EAGLE heads train on the accepted path only: discard-branch positions were never committed, so the
trace has no target features for them, and feeding the head's own predicted features would teach it
its own errors. The rejected-token term still reaches the head because its context (the row of the
rejection) is on the accepted path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from feedback.bus.trace import TraceRecord


@dataclass
class SequenceExample:
    request_id: str
    tokens: np.ndarray  # [L] int64
    ctx_len: np.ndarray  # [M] int64, 1..L: the row predicts the token after tokens[:ctx_len]
    topk_ids: np.ndarray  # [M, T] int64, -1 padded (full target vocabulary)
    topk_logprobs: np.ndarray  # [M, T] float32
    rejected_ids: np.ndarray  # [M] int64, -1 where no drafted token was rejected at this row
    weights: np.ndarray  # [M] float32
    discard: bool
    """True for a discarded-branch sequence."""
    features: np.ndarray | None = None
    """[L or L-1, F] uint16 bf16 bits of the target's features (main sequences only)."""
    created_at: float = 0.0

    @property
    def num_rows(self) -> int:
        return int(self.ctx_len.shape[0])


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """uint16 bf16 bit patterns -> float32 (exact)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def build_examples(
    record: TraceRecord,
    *,
    discard_weight: float = 0.5,
    include_discard: bool = True,
    max_len: int | None = None,
    weight: float = 1.0,
) -> list[SequenceExample]:
    """Main sequence first, then one branch per rejecting step (if ``include_discard``).

    ``weight`` scales every row (the replay buffer's recency weight); branch rows get
    ``weight * discard_weight``. ``max_len`` left-truncates sequences (rows left without any
    context are dropped).
    """
    prompt = np.asarray(record.prompt_ids, dtype=np.int64)
    output = np.asarray(record.output_ids, dtype=np.int64)
    st = record.steps
    P = len(prompt)
    main_rows: list[tuple[int, int, int, int]] = []  # (ctx_len, step, row, rejected_id)
    branches: list[SequenceExample] = []
    for s in range(st.num_steps):
        pos, nd, na = int(st.positions[s]), int(st.num_drafted[s]), int(st.num_accepted[s])
        for j in range(na + 1):
            rejected = int(st.draft_ids[s, j]) if (j == na and na < nd) else -1
            main_rows.append((P + pos + j, s, j, rejected))
        if include_discard and na < nd:
            rows = list(range(na + 1, nd + 1))
            tokens = np.concatenate([prompt, output[:pos], st.draft_ids[s, :nd].astype(np.int64)])
            ctx = np.array([P + pos + j for j in rows], dtype=np.int64)
            ex = SequenceExample(
                request_id=record.request_id,
                tokens=tokens,
                ctx_len=ctx,
                topk_ids=st.target_topk_ids[s, rows].astype(np.int64),
                topk_logprobs=st.target_topk_logprobs[s, rows].astype(np.float32),
                rejected_ids=np.full(len(rows), -1, dtype=np.int64),
                weights=np.full(len(rows), weight * discard_weight, dtype=np.float32),
                discard=True,
                created_at=record.finished_at,
            )
            branches.append(ex)
    steps = np.array([r[1] for r in main_rows], dtype=np.int64)
    rows = np.array([r[2] for r in main_rows], dtype=np.int64)
    main = SequenceExample(
        request_id=record.request_id,
        tokens=np.concatenate([prompt, output]),
        ctx_len=np.array([r[0] for r in main_rows], dtype=np.int64),
        topk_ids=st.target_topk_ids[steps, rows].astype(np.int64),
        topk_logprobs=st.target_topk_logprobs[steps, rows].astype(np.float32),
        rejected_ids=np.array([r[3] for r in main_rows], dtype=np.int64),
        weights=np.full(len(main_rows), weight, dtype=np.float32),
        discard=False,
        features=record.hidden_states,
        created_at=record.finished_at,
    )
    out = [main, *branches]
    if max_len is not None:
        out = [e for e in (truncate_left(e, max_len) for e in out) if e.num_rows]
    return out


def truncate_left(ex: SequenceExample, max_len: int) -> SequenceExample:
    """Keep the last ``max_len`` tokens and the rows whose context still has at least one token."""
    cut = len(ex.tokens) - max_len
    if cut <= 0:
        return ex
    keep = ex.ctx_len - cut >= 1
    return SequenceExample(
        request_id=ex.request_id,
        tokens=ex.tokens[cut:],
        ctx_len=ex.ctx_len[keep] - cut,
        topk_ids=ex.topk_ids[keep],
        topk_logprobs=ex.topk_logprobs[keep],
        rejected_ids=ex.rejected_ids[keep],
        weights=ex.weights[keep],
        discard=ex.discard,
        features=None if ex.features is None else ex.features[cut:],
        created_at=ex.created_at,
    )


def trace_key(record: TraceRecord) -> bytes:
    """Content key for dedup: the same (prompt, output) teaches the same thing twice."""
    import hashlib

    h = hashlib.blake2b(digest_size=16)
    h.update(np.asarray(record.prompt_ids, dtype=np.int64).tobytes())
    h.update(b"|")
    h.update(np.asarray(record.output_ids, dtype=np.int64).tobytes())
    return h.digest()


def stack_topk(arrays: list[np.ndarray], fill: float) -> np.ndarray:
    """Concatenate [M_i, T_i] top-k rows of traces that may differ in T (replicas tracing different
    top-k widths), padding the narrower ones with ``fill`` (-1 for ids, -inf for log-probs)."""
    width = max(a.shape[1] for a in arrays)
    return np.concatenate([a if a.shape[1] == width else
                           np.pad(a, ((0, 0), (0, width - a.shape[1])), constant_values=fill)
                           for a in arrays])  # the common case (one width) copies once


def count_rows(examples: list[SequenceExample]) -> tuple[int, int]:
    """(accepted-path rows, discard-branch rows)."""
    main = sum(e.num_rows for e in examples if not e.discard)
    return main, sum(e.num_rows for e in examples if e.discard)
