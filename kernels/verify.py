"""Speculative verify/accept: greedy match and lossless rejection sampling, vectorised over B and k.

Conventions: row i drafted ``draft_lengths[i]`` tokens (``draft_tokens[i, :len]``; the rest is
padding) and the target scored k+1 positions: position j is the target's distribution for the token
after the context + the first j drafts. A step emits ``draft_tokens[i, :num_accepted[i]]`` followed
by ``next_tokens[i]`` (the correction after a rejection, or the bonus token when all were accepted).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kernels.sampling import Generators, ParamLike, probs_from_logits, sample_from_uniform


@dataclass
class VerifyResult:
    num_accepted: Tensor  # [B] int64, 0..draft_lengths
    next_tokens: Tensor  # [B] int64, emitted after the accepted prefix

    def emitted(self, draft_tokens: Tensor) -> list[list[int]]:
        """Per row, the tokens this step commits: accepted drafts then the next token."""
        drafts = draft_tokens.tolist()
        return [
            drafts[i][:n] + [t]
            for i, (n, t) in enumerate(zip(self.num_accepted.tolist(), self.next_tokens.tolist()))
        ]


def _accepted_prefix(accept: Tensor, draft_lengths: Tensor) -> Tensor:
    """Length of the leading run of True in ``accept`` [B, k], limited to each row's length."""
    k = accept.shape[1]
    in_length = torch.arange(k, device=accept.device) < draft_lengths.unsqueeze(1)  # [B, k]
    return (accept & in_length).long().cumprod(dim=1).sum(dim=1)  # [B]


def greedy_verify(
    draft_tokens: Tensor, draft_lengths: Tensor, target_logits: Tensor
) -> VerifyResult:
    """Accept the longest prefix where the target's argmax equals the draft.

    ``target_logits`` [B, k+1, V] (probabilities work too: only the argmax is read).
    """
    k = draft_tokens.shape[1]
    target_ids = target_logits.argmax(dim=-1)  # [B, k+1]
    accept = target_ids[:, :k] == draft_tokens  # [B, k]
    num_accepted = _accepted_prefix(accept, draft_lengths.to(target_ids.device))  # [B]
    next_tokens = target_ids.gather(1, num_accepted.unsqueeze(1)).squeeze(1)  # [B]
    return VerifyResult(num_accepted=num_accepted, next_tokens=next_tokens)


def _verify_uniforms(
    draft_lengths: Tensor, k: int, generators: Generators, device: torch.device
) -> tuple[Tensor, Tensor]:
    """Acceptance uniforms [B, k] and final-sample uniforms [B] (float64).

    A row with a generator draws exactly len+1 numbers from it (its len acceptance tests, then the
    final sample), so its stream depends on its own draft only, not on the batch's padded k.
    """
    batch = draft_lengths.shape[0]
    u_accept = torch.rand(batch, k, dtype=torch.float64, device=device)  # [B, k]
    u_final = torch.rand(batch, dtype=torch.float64, device=device)  # [B]
    if generators is not None and any(g is not None for g in generators):
        lengths = draft_lengths.tolist()
        for i, g in enumerate(generators):  # per-row RNG only: the math below is batched
            if g is None:
                continue
            n = lengths[i]
            r = torch.rand(n + 1, dtype=torch.float64, generator=g, device=g.device).to(device)
            u_accept[i, :n] = r[:n]
            u_final[i] = r[n]
    return u_accept, u_final


def rejection_verify(
    draft_tokens: Tensor,
    draft_lengths: Tensor,
    draft_token_probs: Tensor | None,
    draft_dists: Tensor | None,
    target_probs: Tensor,
    generators: Generators = None,
) -> VerifyResult:
    """Lossless speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

    Draft j (j < len) is accepted with probability min(1, p_j(x)/q_j(x)); at the first rejection the
    next token is drawn from normalise(max(0, p_j - q_j)); if all ``len`` drafts are accepted, the
    bonus token is drawn from p_len. Emitted tokens are then distributed exactly as the target's.

    ``target_probs`` [B, k+1, V]: normalised target sampling distributions (``probs_from_logits``).
    ``draft_dists`` [B, k, V]: the distributions the drafts were sampled from, or None when every
    draft is a point mass (deterministic drafter: q(x) = 1, so the residual is p with x removed).
    ``draft_token_probs`` [B, k] is not read: q(x) is taken from ``draft_dists`` (or is 1), so the
    ratio and the residual can never disagree. A learned drafter that drafts its argmax must pass
    ``draft_dists=None``; its softmax probability is not the q it sampled from.
    A residual with no mass (p == q up to rounding) falls back to p.
    """
    del draft_token_probs
    batch, k = draft_tokens.shape
    device = target_probs.device
    p = target_probs.float()  # [B, k+1, V]
    lengths = draft_lengths.to(device)
    u_accept, u_final = _verify_uniforms(lengths, k, generators, device)
    if k == 0:
        zeros = torch.zeros(batch, dtype=torch.long, device=device)
        return VerifyResult(num_accepted=zeros, next_tokens=sample_from_uniform(p[:, 0], u_final))

    x = draft_tokens.to(device).long().unsqueeze(-1)  # [B, k, 1]
    p_x = p[:, :k].gather(-1, x).squeeze(-1)  # [B, k]
    if draft_dists is None:
        q_x = torch.ones_like(p_x)  # [B, k]
    else:
        q_x = draft_dists.float().gather(-1, x).squeeze(-1)  # [B, k]
    # u < p/q, written without the division (q = 0 accepts iff p > 0)
    accept = u_accept * q_x < p_x  # [B, k]
    num_accepted = _accepted_prefix(accept, lengths)  # [B]

    vocab = p.shape[-1]
    at = num_accepted.view(batch, 1, 1).expand(batch, 1, vocab)  # [B, 1, V]
    p_next = p.gather(1, at).squeeze(1)  # [B, V]
    at_draft = at.clamp(max=k - 1)  # [B, 1, V]
    if draft_dists is None:
        x_next = x.squeeze(-1).gather(1, at_draft[:, :, 0])  # [B, 1]
        q_next = torch.zeros_like(p_next).scatter_(1, x_next, 1.0)  # [B, V]
    else:
        q_next = draft_dists.float().gather(1, at_draft).squeeze(1)  # [B, V]
    residual = (p_next - q_next).clamp(min=0)  # [B, V]
    rejected = (num_accepted < lengths) & (residual.sum(dim=-1) > 0)  # [B]
    dist = torch.where(rejected.unsqueeze(1), residual, p_next)  # [B, V]
    return VerifyResult(num_accepted=num_accepted, next_tokens=sample_from_uniform(dist, u_final))


def verify(
    draft_tokens: Tensor,
    draft_lengths: Tensor,
    target_logits: Tensor,
    temperature: ParamLike,
    top_k: ParamLike = 0,
    top_p: ParamLike = 1.0,
    draft_token_probs: Tensor | None = None,
    draft_dists: Tensor | None = None,
    generators: Generators = None,
) -> VerifyResult:
    """Verify a mixed batch: rows with temperature 0 by greedy match, the others by rejection
    sampling against ``probs_from_logits(target_logits, temperature, top_k, top_p)``.

    ``draft_tokens`` [B, k] int, ``draft_lengths`` [B] int, ``target_logits`` [B, k+1, V] raw
    logits; ``temperature``/``top_k``/``top_p`` scalars or [B]; ``draft_token_probs`` [B, k] and
    ``draft_dists`` [B, k, V] | None as in ``rejection_verify``; ``generators`` one per row
    (None entries: global RNG). Greedy rows draw no random numbers.
    """
    batch = draft_tokens.shape[0]
    device = target_logits.device
    temp = torch.as_tensor(temperature, dtype=torch.float32, device=device).expand(batch)  # [B]
    greedy = temp == 0  # [B]
    if bool(greedy.all()):
        return greedy_verify(draft_tokens, draft_lengths, target_logits)
    top_k_rows = torch.as_tensor(top_k, dtype=torch.int64, device=device).expand(batch)  # [B]
    top_p_rows = torch.as_tensor(top_p, dtype=torch.float32, device=device).expand(batch)  # [B]
    if not bool(greedy.any()):
        probs = probs_from_logits(target_logits, temp, top_k_rows, top_p_rows)  # [B, k+1, V]
        return rejection_verify(
            draft_tokens, draft_lengths, draft_token_probs, draft_dists, probs, generators
        )

    num_accepted = torch.zeros(batch, dtype=torch.long, device=device)
    next_tokens = torch.zeros(batch, dtype=torch.long, device=device)
    g_rows = greedy.nonzero().squeeze(1)  # [Bg]
    s_rows = (~greedy).nonzero().squeeze(1)  # [Bs]
    g = greedy_verify(draft_tokens[g_rows], draft_lengths[g_rows], target_logits[g_rows])
    probs = probs_from_logits(
        target_logits[s_rows], temp[s_rows], top_k_rows[s_rows], top_p_rows[s_rows]
    )  # [Bs, k+1, V]
    s = rejection_verify(
        draft_tokens[s_rows],
        draft_lengths[s_rows],
        None if draft_token_probs is None else draft_token_probs[s_rows],
        None if draft_dists is None else draft_dists[s_rows],
        probs,
        None if generators is None else [generators[i] for i in s_rows.tolist()],
    )
    num_accepted[g_rows], next_tokens[g_rows] = g.num_accepted, g.next_tokens
    num_accepted[s_rows], next_tokens[s_rows] = s.num_accepted, s.next_tokens
    return VerifyResult(num_accepted=num_accepted, next_tokens=next_tokens)


def expected_acceptance(
    target_topk_ids: Tensor, target_topk_logprobs: Tensor, draft_probs_full: Tensor
) -> Tensor:
    """Per-position acceptance probability of a draft sampled from q: sum_x min(p(x), q(x)).

    Only the target's top-k is known (``target_topk_ids`` [N, T], -1 padded;
    ``target_topk_logprobs`` [N, T], full-vocab log-probabilities), so the sum runs over that
    support: a lower bound on the true value, short by at most min(p_tail, q_tail) where the tails
    are the masses outside the top-k. ``draft_probs_full`` [N, V]. Returns [N] float32.
    For a greedy (argmax) drafter pass its one-hot: the result is p(draft token).
    """
    valid = target_topk_ids >= 0  # [N, T]
    ids = target_topk_ids.long().clamp(min=0)  # [N, T]
    p = target_topk_logprobs.float().exp()  # [N, T]
    q = draft_probs_full.float().gather(-1, ids)  # [N, T]
    return torch.where(valid, torch.minimum(p, q), torch.zeros_like(p)).sum(dim=-1)  # [N]
