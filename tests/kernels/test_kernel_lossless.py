"""Rejection sampling must be lossless: emitted tokens are distributed exactly as the target's.

Setup: a target whose distribution at output position t is P[t], independent of the prefix, and a
drafter that drafts position t from Q[t] (full distributions) or picks it from R[t] and reports a
point mass (model-free drafter). A large batch of independent rows runs the real loop (draft, verify,
emit accepted + next token, repeat) until every row has emitted two tokens; lengths are random
in 0..k. Then token 0 ~ P[0], token 1 ~ P[1], and (token 0, token 1) ~ P[0] x P[1].

Tolerance: for n samples over c cells, E[TVD] <= 0.5 * sqrt(c / n) (Cauchy-Schwarz), and TVD moves
by at most 1/n per sample, so P(TVD > E + t) <= exp(-2 n t^2) (McDiarmid): t = 0.005 with
n = 200k gives exp(-10). A fixed seed makes the run deterministic anyway.
"""

import math

import pytest
import torch

from kernels.sampling import sample
from kernels.verify import expected_acceptance, rejection_verify

V = 6
N = 200_000
MAX_K = 3


def tolerance(cells: int, n: int = N) -> float:
    return 0.5 * math.sqrt(cells / n) + 0.005


def tvd(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    freq = torch.bincount(tokens, minlength=probs.numel()).double() / tokens.numel()
    return 0.5 * (freq - probs.flatten().double()).abs().sum().item()


def make_dists(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Target P [M, V] and drafting distribution Q [M, V], far apart (TVD > 0.2 per position)."""
    g = torch.Generator().manual_seed(seed)
    m = 2 + MAX_K + 1
    p = (torch.randn(m, V, generator=g) * 1.5).softmax(-1)
    p[0, 5] = 0.0  # a token the target never emits, the drafter sometimes proposes
    p = p / p.sum(-1, keepdim=True)
    q = (torch.randn(m, V, generator=g) * 1.5).softmax(-1)
    assert (0.5 * (p - q).abs().sum(-1) > 0.2).all(), "pick a seed where drafts differ from p"
    return p, q


def run_loop(p, q, k, point_mass, verifier, n_rows=N, seeded=False, seed=0):
    """Simulate the speculative loop until every row emitted 2 tokens. Returns (tokens [n, 2],
    first-step (lengths, num_accepted, drafts)). ``seeded``: every row has its own generator."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # verify's uniforms for rows without a generator
    row_gens = [torch.Generator().manual_seed(seed + i) for i in range(n_rows)] if seeded else None
    emitted = torch.full((n_rows, 2), -1, dtype=torch.long)
    count = torch.zeros(n_rows, dtype=torch.long)
    first_step = None
    while (count < 2).any():
        rows = (count < 2).nonzero().squeeze(1)  # [n]
        n = rows.numel()
        positions = count[rows].unsqueeze(1) + torch.arange(k + 1)  # [n, k+1]
        target = p[positions]  # [n, k+1, V]
        dists = q[positions[:, :k]]  # [n, k, V]
        drafts = torch.multinomial(dists.reshape(-1, V), 1, generator=g).reshape(n, k)  # [n, k]
        lengths = torch.randint(0, k + 1, (n,), generator=g)  # [n]
        gens = None if row_gens is None else [row_gens[i] for i in rows.tolist()]
        res = verifier(drafts, lengths, None if point_mass else dists, target, gens)
        if first_step is None:
            first_step = (lengths, res.num_accepted, drafts)
        for j in range(k + 1):  # write the step's tokens at output positions count + j
            tok = torch.where(j < res.num_accepted, drafts[:, min(j, k - 1)], res.next_tokens)
            out_pos = count[rows] + j
            write = (j <= res.num_accepted) & (out_pos < 2)
            emitted[rows[write], out_pos[write]] = tok[write]
        count[rows] += res.num_accepted + 1
    return emitted, first_step


def reference_verifier(drafts, lengths, dists, target, generators):
    return rejection_verify(drafts, lengths, None, dists, target, generators)


def check_lossless(p, q, k, point_mass, verifier, n_rows=N, seeded=False):
    tokens, (lengths, num_accepted, _) = run_loop(p, q, k, point_mass, verifier, n_rows, seeded)
    assert (tokens >= 0).all()
    d0, d1 = tvd(tokens[:, 0], p[0]), tvd(tokens[:, 1], p[1])
    joint = tvd(tokens[:, 0] * V + tokens[:, 1], torch.outer(p[0], p[1]))
    return d0, d1, joint, lengths, num_accepted


@pytest.mark.parametrize("point_mass", [False, True], ids=["draft-dists", "point-mass"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_rejection_sampling_is_lossless(k, point_mass):
    p, q = make_dists(seed=k)
    d0, d1, joint, lengths, num_accepted = check_lossless(p, q, k, point_mass, reference_verifier)
    assert d0 < tolerance(V), d0
    assert d1 < tolerance(V), d1
    assert joint < tolerance(V * V), joint

    # acceptance of the first draft: sum_x min(p, q) for sampled drafts; for point masses drafted
    # from q, each x is accepted with prob p(x), so the rate is sum_x q(x) p(x)
    drafted = lengths >= 1
    rate = (num_accepted[drafted] >= 1).double().mean().item()
    expected = (p[0] * q[0]).sum() if point_mass else torch.minimum(p[0], q[0]).sum()
    assert rate == pytest.approx(expected.item(), abs=tolerance(2, int(drafted.sum())))
    if not point_mass:
        gate = expected_acceptance(torch.arange(V)[None], p[0].log()[None], q[0][None])
        assert gate.item() == pytest.approx(expected.item(), abs=1e-6)


def test_the_check_catches_a_biased_verifier():
    """Resampling from p (not the residual) after a rejection is a classic bug: it must fail."""

    def resample_from_p(drafts, lengths, dists, target, generators):
        res = rejection_verify(drafts, lengths, None, dists, target, generators)
        rejected = res.num_accepted < lengths
        p_at = target[torch.arange(len(drafts)), res.num_accepted]  # [n, V]
        res.next_tokens = torch.where(rejected, sample(p_at), res.next_tokens)
        return res

    p, q = make_dists(seed=1)
    d0, d1, _, _, _ = check_lossless(p, q, 1, False, resample_from_p)
    assert max(d0, d1) > 2 * tolerance(V)


def test_lossless_with_per_row_generators():
    """Seeded rows draw their uniforms from their own generator: those draws must be independent
    too (e.g. the bonus sample must not reuse an acceptance uniform)."""
    n_rows = 40_000
    p, q = make_dists(seed=4)
    d0, d1, joint, _, _ = check_lossless(p, q, 1, False, reference_verifier, n_rows, seeded=True)
    assert d0 < tolerance(V, n_rows), d0
    assert d1 < tolerance(V, n_rows), d1
    assert joint < tolerance(V * V, n_rows), joint
