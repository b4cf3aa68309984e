"""Distillation losses of a drafter (student) against the target's top-k as stored in traces.

A trace keeps only the target's top-T (ids, full-vocab logprobs) per position, so teacher and
student are compared over T+1 buckets: the T top-k tokens plus a "tail" bucket holding everything
else (teacher: 1 - sum of its top-k probs; student: its mass outside those ids). With
``renormalise=True`` the tail is dropped and both sides are renormalised over the top-k.
Ids of -1 are padding: such a bucket has zero mass on both sides (the student's mass on it stays in
the tail). Everything is computed in fp32 whatever the input dtype.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

LossKind = Literal["fkl", "rkl", "jsd", "tvd"]

# Floor for log-probabilities of empty buckets: exp() of it is 0 in fp32, it stays finite so that
# 0 * log terms and their gradients are 0 rather than NaN.
LOG_FLOOR = -1.0e4
# Teacher probabilities are clamped to this inside logs (rkl/jsd: a student bucket the teacher
# gives 0, e.g. the tail when the top-k holds all the mass, costs a finite amount).
TEACHER_EPS = 1.0e-10


def topk_buckets(
    student_logits: Tensor,
    target_topk_ids: Tensor,
    target_topk_logprobs: Tensor,
    renormalise: bool = False,
) -> tuple[Tensor, Tensor]:
    """Teacher probs and student log-probs over the T+1 buckets (top-k ids, then the tail).

    ``student_logits`` [N, V]; ``target_topk_ids`` [N, T] (-1 padded); ``target_topk_logprobs``
    [N, T]. Returns (teacher_probs [N, T+1], student_logprobs [N, T+1]); each side sums to 1 per
    row (a teacher whose stored top-k sums above 1, e.g. from fp16 rounding, is rescaled).
    """
    logits = student_logits.float()  # [N, V]
    valid = target_topk_ids >= 0  # [N, T]
    ids = target_topk_ids.long().clamp(min=0)  # [N, T]
    teacher = torch.where(valid, target_topk_logprobs.float().exp(), 0.0)  # [N, T]
    picked = logits.gather(-1, ids)  # [N, T]

    if renormalise:
        teacher = teacher / teacher.sum(-1, keepdim=True).clamp(min=TEACHER_EPS)
        teacher_tail = torch.zeros_like(teacher[:, :1])  # [N, 1]
        # finfo.min, not -inf: an all-padding row stays finite (its buckets are floored below)
        picked = picked.masked_fill(~valid, torch.finfo(torch.float32).min)  # [N, T]
        student_top = picked.log_softmax(dim=-1)  # [N, T]
        student_tail = torch.full_like(teacher_tail, LOG_FLOOR)  # [N, 1]
    else:
        top_mass = teacher.sum(-1, keepdim=True)  # [N, 1]
        teacher_tail = (1.0 - top_mass).clamp(min=0.0)  # [N, 1]
        total = top_mass + teacher_tail  # [N, 1], max(1, top_mass)
        teacher, teacher_tail = teacher / total, teacher_tail / total
        log_norm = logits.logsumexp(dim=-1, keepdim=True)  # [N, 1]
        student_top = picked - log_norm  # [N, T]
        # padding scatters into an extra column V (dropped), so it cannot clear a real id's flag
        vocab = logits.shape[-1]
        slot = torch.where(valid, ids, vocab)  # [N, T]
        in_topk = logits.new_zeros(logits.shape[0], vocab + 1, dtype=torch.bool)  # [N, V+1]
        in_topk = in_topk.scatter(-1, slot, True)[:, :vocab]  # [N, V]
        # finfo.min rather than -inf: when the top-k covers the whole vocabulary the tail's
        # logsumexp stays finite (no -inf - -inf); filled entries get no gradient either way.
        rest = logits.masked_fill(in_topk, torch.finfo(torch.float32).min)  # [N, V]
        student_tail = rest.logsumexp(dim=-1, keepdim=True) - log_norm  # [N, 1]

    student_top = torch.where(valid, student_top, LOG_FLOOR)  # [N, T]
    student = torch.cat([student_top, student_tail], dim=-1).clamp(min=LOG_FLOOR)  # [N, T+1]
    return torch.cat([teacher, teacher_tail], dim=-1), student


def _divergence(teacher: Tensor, student_logprobs: Tensor, kind: LossKind) -> Tensor:
    """Per-row divergence between bucket distributions ([N, B] each). Returns [N]."""
    p, log_q = teacher, student_logprobs  # [N, B]
    q = log_q.exp()  # [N, B]
    log_p = p.clamp(min=TEACHER_EPS).log()  # [N, B]
    if kind == "fkl":  # KL(p || q): mass-covering
        return (p * (log_p - log_q)).sum(-1)
    if kind == "rkl":  # KL(q || p): mode-seeking
        return (q * (log_q - log_p)).sum(-1)
    if kind == "jsd":  # 0.5 KL(p || m) + 0.5 KL(q || m), m = (p + q) / 2
        log_m = torch.logaddexp(log_p, log_q) - math.log(2.0)  # [N, B]
        return 0.5 * (p * (log_p - log_m)).sum(-1) + 0.5 * (q * (log_q - log_m)).sum(-1)
    if kind == "tvd":  # 0.5 sum |p - q|: 1 - tvd is the acceptance rate over the buckets
        return 0.5 * (p - q).abs().sum(-1)
    raise ValueError(f"unknown loss kind {kind!r} (fkl|rkl|jsd|tvd)")


def _weighted_mean(values: Tensor, weights: Tensor | None, keep: Tensor | None = None) -> Tensor:
    """sum(w * v) / sum(w) over rows with ``keep``; 0 (still differentiable) when nothing is kept."""
    w = torch.ones_like(values) if weights is None else weights.float().to(values.device)  # [N]
    if keep is not None:
        w = w * keep.float()
        values = torch.where(keep, values, 0.0)
    total = w.sum()
    return (w * values).sum() / total.clamp(min=torch.finfo(torch.float32).tiny)


def distill_loss_per_position(
    student_logits: Tensor,
    target_topk_ids: Tensor,
    target_topk_logprobs: Tensor,
    kind: LossKind = "fkl",
    renormalise: bool = False,
) -> Tensor:
    """Divergence between target and student at each position over the top-k buckets: [N] fp32."""
    teacher, student = topk_buckets(
        student_logits, target_topk_ids, target_topk_logprobs, renormalise
    )
    return _divergence(teacher, student, kind)


def distill_loss(
    student_logits: Tensor,
    target_topk_ids: Tensor,
    target_topk_logprobs: Tensor,
    kind: LossKind = "fkl",
    weights: Tensor | None = None,
    renormalise: bool = False,
) -> Tensor:
    """Weighted mean over positions of ``distill_loss_per_position`` (``weights`` [N] or None)."""
    per_position = distill_loss_per_position(
        student_logits, target_topk_ids, target_topk_logprobs, kind, renormalise
    )
    return _weighted_mean(per_position, weights)


def discard_loss(
    student_logits: Tensor, rejected_ids: Tensor, weights: Tensor | None = None
) -> Tensor:
    """Unlikelihood on drafts the target rejected: mean of -log(1 - q(x_rejected)).

    Pushes the student's probability of a token the verifier threw away towards 0, and only that
    token: the freed mass is spread over the rest of the vocabulary in proportion to the student's
    own probabilities (the positive direction comes from ``distill_loss`` on the same position).
    This is the "rejected draft" signal of Aurora-style online distillation. Under sampled
    verification a rejected token can still have sizeable target probability, so use a small
    weight there (or weight rows by how far q(x) exceeded p(x)).

    ``student_logits`` [N, V]; ``rejected_ids`` [N] (-1: no rejected draft at this position,
    ignored); ``weights`` [N] or None. log(1 - q(x)) is computed as logsumexp over the other
    logits minus logsumexp over all, so it stays finite as q(x) -> 1.
    """
    logits = student_logits.float()  # [N, V]
    keep = rejected_ids >= 0  # [N]
    ids = rejected_ids.long().clamp(min=0).unsqueeze(-1)  # [N, 1]
    others = logits.scatter(-1, ids, torch.finfo(torch.float32).min)  # [N, V]
    log_not_x = others.logsumexp(-1) - logits.logsumexp(-1)  # [N] log(1 - q(x))
    return _weighted_mean(-log_not_x.clamp(min=LOG_FLOOR), weights, keep)


def next_token_ce(student_logits: Tensor, labels: Tensor, weights: Tensor | None = None) -> Tensor:
    """Weighted mean cross-entropy against ``labels`` [N] (negative labels are ignored)."""
    keep = labels >= 0  # [N]
    ce = F.cross_entropy(
        student_logits.float(), labels.long().clamp(min=0), reduction="none"
    )  # [N]
    return _weighted_mean(ce, weights, keep)
