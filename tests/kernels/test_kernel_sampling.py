import math

import pytest
import torch

from kernels.sampling import probs_from_logits, sample, sample_from_uniform


def test_temperature_scales_logits():
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.5, -1.0, 2.0]])
    probs = probs_from_logits(logits, torch.tensor([0.5, 2.0]))
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs[0], (logits[0] / 0.5).softmax(-1))
    torch.testing.assert_close(probs[1], (logits[1] / 2.0).softmax(-1))


def test_temperature_zero_is_one_hot_at_argmax():
    logits = torch.tensor([[0.1, 5.0, 0.3, 4.9], [3.0, 1.0, 2.0, 0.0]])
    probs = probs_from_logits(logits, torch.tensor([0.0, 1.0]), top_k=torch.tensor([2, 0]))
    assert probs[0].tolist() == [0.0, 1.0, 0.0, 0.0]
    assert probs[1].sum().item() == pytest.approx(1.0)
    assert (probs[1] > 0).all()


def test_top_k_keeps_exactly_the_k_largest():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    top_k = torch.tensor([1, 5, 0, 50])
    probs = probs_from_logits(logits, 1.0, top_k)
    for row, k in enumerate(top_k.tolist()):
        kept = set((probs[row] > 0).nonzero().squeeze(1).tolist())
        expected = set(logits[row].topk(k or 50).indices.tolist())
        assert kept == expected
        renorm = logits[row].masked_fill(probs[row] == 0, float("-inf")).softmax(-1)
        torch.testing.assert_close(probs[row], renorm)


def test_top_p_keeps_smallest_prefix_reaching_p():
    # sorted probs 0.5, 0.3, 0.15, 0.05
    base = torch.tensor([0.15, 0.5, 0.05, 0.3]).log()
    logits = base.expand(4, 4)
    probs = probs_from_logits(logits, 1.0, 0, torch.tensor([0.5, 0.6, 0.9, 1.0]))
    assert (probs[0] > 0).tolist() == [False, True, False, False]  # 0.5 reaches 0.5
    assert (probs[1] > 0).tolist() == [False, True, False, True]  # 0.5 + 0.3
    assert (probs[2] > 0).tolist() == [True, True, False, True]  # 0.5 + 0.3 + 0.15
    assert (probs[3] > 0).all()
    torch.testing.assert_close(probs[1], torch.tensor([0.0, 0.5 / 0.8, 0.0, 0.3 / 0.8]))


def test_top_k_then_top_p_on_the_top_k_distribution():
    logits = torch.tensor([[0.15, 0.5, 0.05, 0.3]]).log()
    # top-2 renormalised: 0.625, 0.375 -> top_p 0.6 keeps only the first
    probs = probs_from_logits(logits, 1.0, 2, 0.6)
    assert probs[0].tolist() == [0.0, 1.0, 0.0, 0.0]


def test_three_dim_logits_use_row_params_at_every_position():
    torch.manual_seed(1)
    logits = torch.randn(2, 3, 10, dtype=torch.bfloat16)
    probs = probs_from_logits(logits, torch.tensor([0.0, 0.7]), torch.tensor([0, 3]), 1.0)
    assert probs.shape == (2, 3, 10) and probs.dtype == torch.float32
    assert torch.equal(probs[0].argmax(-1), logits[0].float().argmax(-1))
    assert torch.equal(probs[0].amax(-1), torch.ones(3))
    assert ((probs[1] > 0).sum(-1) == 3).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 3))


def test_sample_matches_distribution_and_skips_zero_mass():
    torch.manual_seed(2)
    p = torch.tensor([0.1, 0.0, 0.6, 0.3, 0.0])
    n = 100_000
    tokens = sample(p.expand(n, 5))
    freq = torch.bincount(tokens, minlength=5).double() / n
    assert freq[1] == 0 and freq[4] == 0
    # E[TVD] <= 0.5 * sqrt(V / n) ~ 0.0035; TVD concentrates within ~0.005 (McDiarmid)
    assert 0.5 * (freq - p.double()).abs().sum() < 0.5 * math.sqrt(5 / n) + 0.005


def test_inverse_cdf_edges_never_pick_zero_mass_tokens():
    probs = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.0, 1.0, 0.0, 0.0]])
    u = torch.tensor([0.0, 1.0 - 1e-16], dtype=torch.float64)
    assert sample_from_uniform(probs, u).tolist() == [1, 1]
    # unnormalised rows are fine
    assert sample_from_uniform(torch.tensor([[0.0, 2.0, 2.0]]), torch.tensor([0.75])).tolist() == [
        2
    ]


def test_seeded_rows_reproducible_regardless_of_batch():
    torch.manual_seed(3)
    probs = torch.rand(6, 40).softmax(-1)
    alone = sample(probs[2:3], [torch.Generator().manual_seed(123)])
    gens = [
        None,
        torch.Generator().manual_seed(7),
        torch.Generator().manual_seed(123),
        None,
        None,
        None,
    ]
    in_batch = sample(probs, gens)
    assert in_batch[2] == alone[0]
    # and a different seed can give a different token (the generator is actually used)
    draws = {sample(probs[2:3], [torch.Generator().manual_seed(s)]).item() for s in range(50)}
    assert len(draws) > 1


def test_only_rows_that_run_off_the_cdf_are_read_again():
    """On the CPU the last positive token is looked up only for rows whose target reached the total;
    the tokens are those of clamping every row to it."""
    g = torch.Generator().manual_seed(4)
    probs = torch.rand(64, 50, generator=g)
    probs[probs < 0.5] = 0.0  # zero mass anywhere, the tail included
    probs[:, -5:] = 0.0
    u = torch.rand(64, generator=g, dtype=torch.float64)
    u[:8] = 1.0 - 1e-17  # these round up to the total
    cdf = probs.double().cumsum(-1)
    every = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    last_positive = 49 - (probs > 0).flip(-1).int().argmax(-1)
    got = sample_from_uniform(probs, u)
    assert torch.equal(got, torch.minimum(every, last_positive))
    assert bool((probs[torch.arange(64), got] > 0).all())
