"""Reduce one SGLang verify step to the trace's per-step fields: on the device, into one tensor.

SGLang verifies a tree of N nodes per request (a chain when ``topk == 1``). Node 0 is the root,
the last committed token; every other node is a drafted token. For each request the trace keeps
one chain of depth D (= speculative_num_steps): the accepted path, continued past the first
rejection along first children (the top draft branch, the "discarded" positions the target
scored anyway). Row j of the target top-k is the target's distribution after path node j, i.e.
for output position ``root + 1 + j`` given the path so far -- the layout of feedback/bus/trace.py.

Everything here is a pure function of tensors (CPU tensors work too); the plugin adds the
sampling, the single host copy and the export.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels.topk_logprobs import topk_logprobs_reference

_I32 = torch.int32


@dataclass
class VerifyTensors:
    """One verify step of B requests, batch-major (every tensor's dim 0 is the request)."""

    draft_tokens: torch.Tensor  # [B, N] int64 tree tokens; node 0 = root (last committed token)
    first_child: torch.Tensor  # [B, N] int64 local index of each node's first child, -1 = leaf
    accept_path: torch.Tensor  # [B, D+1] int64 local node ids of the accepted path, -1 padded
    accept_lens: torch.Tensor  # [B] int accepted drafts + 1 (the bonus token)
    predict: torch.Tensor  # [B, N] int target's token after each node (valid on accept_path)
    root_pos: torch.Tensor  # [B] int64 absolute position of the root token
    draft_probs: torch.Tensor | None = None  # [B, D, V] draft q at each depth (chains only)
    is_chain: bool = False
    """topk == 1: node j sits at depth j, so the path is 0..D whatever was accepted."""

    @property
    def depth(self) -> int:
        return int(self.accept_path.shape[1]) - 1

    def select(self, rows: torch.Tensor) -> VerifyTensors:
        """The subset of requests ``rows`` ([R] int64 on the same device)."""
        pick = lambda t: None if t is None else t.index_select(0, rows)
        return VerifyTensors(
            draft_tokens=pick(self.draft_tokens),
            first_child=pick(self.first_child),
            accept_path=pick(self.accept_path),
            accept_lens=pick(self.accept_lens),
            predict=pick(self.predict),
            root_pos=pick(self.root_pos),
            draft_probs=pick(self.draft_probs),
            is_chain=self.is_chain,
        )


def from_sglang(verify_input, predict: torch.Tensor, accept_lens: torch.Tensor,
                accept_index: torch.Tensor) -> VerifyTensors:
    """View ``eagle_sample``'s input and outputs batch-major. Views and index arithmetic only.

    ``accept_index`` holds global node ids (``b * N + local``), -1 padded; ``predict`` and the
    tree tensors are flat over ``bs * N`` nodes.
    """
    n = int(verify_input.draft_token_num)
    b = int(accept_lens.shape[0])
    base = torch.arange(b, device=accept_index.device, dtype=torch.int64) * n  # [B]
    accept_index = accept_index.to(torch.int64)
    accept_path = torch.where(accept_index >= 0, accept_index - base[:, None], -1)  # [B, D+1]
    depth = int(accept_index.shape[1]) - 1
    is_chain = int(verify_input.topk) == 1 and n == depth + 1
    q = getattr(verify_input, "draft_probs", None)
    if q is not None and (not is_chain or q.dim() != 3 or q.shape[1] != depth):
        q = None
    return VerifyTensors(
        draft_tokens=verify_input.draft_token.reshape(b, n),
        first_child=verify_input.retrieve_next_token.reshape(b, n),
        accept_path=accept_path,
        accept_lens=accept_lens,
        predict=predict.reshape(b, n),
        root_pos=verify_input.positions.reshape(b, n)[:, 0],
        draft_probs=q,
        is_chain=is_chain,
    )


def summarize_target(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k ids (int32) and full-vocab log-probabilities (fp32) of every tree node's target
    distribution: [B, N, V] -> [B, N, T] each, on the logits' device."""
    b, n, v = logits.shape
    ids, logprobs = topk_logprobs_reference(logits.float().reshape(b * n, v), top_k)  # [B*N, T]
    return ids.to(_I32).reshape(b, n, -1), logprobs.reshape(b, n, -1)


def trace_path(v: VerifyTensors) -> torch.Tensor:
    """[B, D+1] local node ids: the accepted path, then first children; -1 past the tree."""
    b, d1 = v.accept_path.shape
    if v.is_chain:
        return torch.arange(d1, device=v.accept_path.device).expand(b, d1)  # [B, D+1]
    num_accepted = v.accept_lens.to(torch.int64) - 1  # [B]
    cols = [v.accept_path[:, 0].clamp(min=0)]  # root
    for j in range(1, d1):
        prev = cols[-1]  # [B]
        child = v.first_child.gather(1, prev.clamp(min=0)[:, None])[:, 0]  # [B]
        child = torch.where(prev >= 0, child, -1)
        cols.append(torch.where(num_accepted >= j, v.accept_path[:, j], child))
    return torch.stack(cols, dim=1)  # [B, D+1]


@dataclass(frozen=True)
class StepLayout:
    """Column layout of the packed [B, width] int32 tensor (float32 stored as raw bits)."""

    depth: int  # D
    top_k: int  # T

    def sections(self) -> list[tuple[str, int]]:
        d, d1, t = self.depth, self.depth + 1, self.top_k
        return [("num_drafted", 1), ("num_accepted", 1), ("root_pos", 1), ("draft_ids", d),
                ("emitted", d1), ("topk_ids", d1 * t), ("topk_logprob_bits", d1 * t),
                ("draft_prob_bits", d)]

    @property
    def width(self) -> int:
        return sum(w for _, w in self.sections())

    def split(self, packed: np.ndarray) -> dict[str, np.ndarray]:
        out, start = {}, 0
        for name, w in self.sections():
            out[name] = packed[:, start:start + w]
            start += w
        return out


def reduce_verify_step(v: VerifyTensors, topk_ids: torch.Tensor,
                       topk_logprobs: torch.Tensor) -> torch.Tensor:
    """Pack the trace fields of every request into one [B, layout.width] int32 tensor.

    ``topk_ids``/``topk_logprobs``: [B, N, T] from ``summarize_target`` over the same requests.
    Columns in ``StepLayout.sections()`` order.
    """
    b, d1 = v.accept_path.shape
    t = topk_ids.shape[-1]
    path = trace_path(v)  # [B, D+1]
    valid = path >= 0  # [B, D+1]
    safe = path.clamp(min=0)  # [B, D+1]
    num_drafted = valid[:, 1:].sum(dim=1)  # [B]
    num_accepted = v.accept_lens.to(torch.int64) - 1  # [B]

    draft_ids = torch.where(valid[:, 1:], v.draft_tokens.gather(1, safe[:, 1:]), -1)  # [B, D]
    emitted_cols = torch.arange(d1, device=path.device)[None, :] < v.accept_lens[:, None]
    emitted = v.predict.gather(1, v.accept_path.clamp(min=0)).to(torch.int64)  # [B, D+1]
    emitted = torch.where(emitted_cols, emitted, -1)

    rows = safe[:, :, None].expand(b, d1, t)  # [B, D+1, T]
    ids = torch.where(valid[:, :, None], topk_ids.gather(1, rows), -1)  # [B, D+1, T]
    lp = torch.where(valid[:, :, None], topk_logprobs.float().gather(1, rows),
                     float("-inf"))  # [B, D+1, T]

    if v.draft_probs is not None:
        q = v.draft_probs.float().gather(2, draft_ids.clamp(min=0)[:, :, None])[:, :, 0]  # [B, D]
        q = torch.where(valid[:, 1:], q, float("nan"))
    else:
        q = torch.full(draft_ids.shape, float("nan"), device=path.device)  # [B, D] unknown q

    packed = torch.cat([
        num_drafted[:, None].to(_I32),
        num_accepted[:, None].to(_I32),
        v.root_pos[:, None].to(_I32),
        draft_ids.to(_I32),
        emitted.to(_I32),
        ids.reshape(b, -1).to(_I32),
        lp.contiguous().view(_I32).reshape(b, -1),
        q.contiguous().view(_I32),
    ], dim=1)  # [B, width]
    return packed


@dataclass
class StepRows:
    """One verify step's trace fields on the host (numpy), R = requests kept this step."""

    num_drafted: np.ndarray  # [R] int16
    num_accepted: np.ndarray  # [R] int16
    root_pos: np.ndarray  # [R] int64 absolute position of the root (last committed) token
    draft_ids: np.ndarray  # [R, D] int32, -1 padded
    draft_probs: np.ndarray  # [R, D] float32, NaN where SGLang did not keep q
    emitted: list[list[int]]  # per row: accepted drafts + bonus token
    target_topk_ids: np.ndarray  # [R, D+1, T] int32, -1 padded
    target_topk_logprobs: np.ndarray  # [R, D+1, T] float16, -inf padded


def unpack_step(packed: np.ndarray, layout: StepLayout) -> StepRows:
    """Inverse of ``reduce_verify_step`` on the host copy ([R, width] int32)."""
    packed = np.ascontiguousarray(packed, dtype=np.int32)
    r, d1, t = packed.shape[0], layout.depth + 1, layout.top_k
    col = layout.split(packed)
    return StepRows(
        num_drafted=col["num_drafted"][:, 0].astype(np.int16),
        num_accepted=col["num_accepted"][:, 0].astype(np.int16),
        root_pos=col["root_pos"][:, 0].astype(np.int64),
        draft_ids=col["draft_ids"].copy(),
        draft_probs=col["draft_prob_bits"].copy().view(np.float32),
        emitted=[[int(x) for x in row if x >= 0] for row in col["emitted"]],
        target_topk_ids=col["topk_ids"].reshape(r, d1, t).copy(),
        target_topk_logprobs=(
            col["topk_logprob_bits"].copy().view(np.float32).reshape(r, d1, t).astype(np.float16)),
    )
