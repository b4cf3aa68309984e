import pytest
import torch

from kernels.sampling import probs_from_logits
from kernels.verify import expected_acceptance, greedy_verify, rejection_verify, verify

V = 8


def logits_with_argmax(ids: list[list[int]]) -> torch.Tensor:
    """[B, k+1, V] logits whose argmax at each position is the given id."""
    ids_t = torch.tensor(ids)
    return torch.nn.functional.one_hot(ids_t, V).float() * 5.0 + 0.01 * torch.arange(V)


def test_greedy_verify_hand_cases():
    drafts = torch.tensor(
        [
            [1, 2, 3],  # all match -> bonus from position 3
            [1, 2, 3],  # mismatch at j=1 -> correction = target argmax at 1
            [1, 2, 3],  # length 2 limits acceptance, next from position 2
            [1, 2, 3],  # length 0 -> next from position 0
            [4, 2, 3],  # mismatch at j=0 although later positions match
        ]
    )
    lengths = torch.tensor([3, 3, 2, 0, 3])
    target = logits_with_argmax(
        [[1, 2, 3, 7], [1, 5, 3, 7], [1, 2, 3, 7], [1, 2, 3, 7], [1, 2, 3, 7]]
    )
    res = greedy_verify(drafts, lengths, target)
    assert res.num_accepted.tolist() == [3, 1, 2, 0, 0]
    assert res.next_tokens.tolist() == [7, 5, 3, 1, 1]
    assert res.num_accepted.dtype == torch.int64 and res.next_tokens.dtype == torch.int64
    assert res.emitted(drafts) == [[1, 2, 3, 7], [1, 5], [1, 2, 3], [1], [1]]


def test_greedy_verify_with_k_zero():
    res = greedy_verify(
        torch.zeros(2, 0, dtype=torch.long),
        torch.zeros(2, dtype=torch.long),
        logits_with_argmax([[4], [6]]),
    )
    assert res.num_accepted.tolist() == [0, 0] and res.next_tokens.tolist() == [4, 6]


def one_hot_probs(ids: list[list[int]]) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(ids), V).float()


def test_rejection_verify_deterministic_cases():
    # p one-hot: acceptance is certain (p(x) = 1) or impossible (p(x) = 0)
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3], [1, 2, 3]])
    lengths = torch.tensor([3, 3, 1, 0])
    p = one_hot_probs([[1, 2, 3, 6], [1, 4, 3, 6], [1, 2, 3, 6], [5, 2, 3, 6]])
    for dists in (None, torch.full((4, 3, V), 1.0 / V)):
        res = rejection_verify(drafts, lengths, torch.ones(4, 3), dists, p)
        assert res.num_accepted.tolist() == [3, 1, 1, 0]
        assert res.next_tokens.tolist() == [6, 4, 2, 5]


def test_point_mass_residual_excludes_the_rejected_token():
    # p(x) = 0.5: rejected about half the time, and then the residual is p without x
    p = torch.tensor([0.5, 0.25, 0.25, 0, 0, 0, 0, 0]).expand(20_000, 2, V)
    drafts = torch.zeros(20_000, 1, dtype=torch.long)
    torch.manual_seed(0)
    res = rejection_verify(drafts, torch.ones(20_000, dtype=torch.long), None, None, p)
    rejected = res.num_accepted == 0
    assert 0.45 < rejected.float().mean() < 0.55
    assert set(res.next_tokens[rejected].tolist()) == {1, 2}


def test_degenerate_residual_falls_back_to_p():
    # q == p: residual is all zero; force the rejection with p(x) = 0 < u * q(x)
    p = torch.tensor([[[0.0, 0.5, 0.5, 0, 0, 0, 0, 0], [1.0] + [0.0] * 7]])
    q = p[:, :1].clone()
    res = rejection_verify(torch.tensor([[0]]), torch.tensor([1]), None, q, p)
    assert res.num_accepted.item() == 0 and res.next_tokens.item() in (1, 2)


def random_case(batch: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(batch, k + 1, V, generator=g).softmax(-1)
    dists = torch.randn(batch, k, V, generator=g).softmax(-1)
    drafts = torch.multinomial(dists.reshape(-1, V), 1, generator=g).reshape(batch, k)
    lengths = torch.randint(0, k + 1, (batch,), generator=g)
    return drafts, lengths, dists, target


def test_seeded_rows_reproducible_regardless_of_batch_composition():
    drafts, lengths, dists, target = random_case(6, 4, seed=0)
    row = 3
    lengths[row] = 2
    q_x = dists.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    results = set()
    for other_seed in range(5):
        gens = [torch.Generator().manual_seed(other_seed + 100 * i) for i in range(6)]
        gens[row] = torch.Generator().manual_seed(42)
        gens[0] = None
        batch = rejection_verify(drafts, lengths, q_x, dists, target, gens)
        results.add((batch.num_accepted[row].item(), batch.next_tokens[row].item()))
    # alone, with a smaller padded k (the row drafted 2 tokens)
    alone = rejection_verify(
        drafts[row : row + 1, :2],
        lengths[row : row + 1],
        q_x[row : row + 1, :2],
        dists[row : row + 1, :2],
        target[row : row + 1, :3],
        [torch.Generator().manual_seed(42)],
    )
    results.add((alone.num_accepted.item(), alone.next_tokens.item()))
    assert len(results) == 1
    # the seed matters: over many seeds the outcome varies
    outcomes = {
        tuple(
            rejection_verify(
                drafts[row : row + 1],
                lengths[row : row + 1],
                None,
                dists[row : row + 1],
                target[row : row + 1],
                [torch.Generator().manual_seed(s)],
            ).next_tokens.tolist()
        )
        for s in range(40)
    }
    assert len(outcomes) > 1


def test_verify_dispatches_mixed_batch():
    drafts, lengths, dists, _ = random_case(6, 3, seed=1)
    logits = torch.randn(6, 4, V, generator=torch.Generator().manual_seed(2))
    temperature = torch.tensor([0.0, 0.8, 0.0, 1.0, 1.3, 0.0])
    top_k = torch.tensor([0, 4, 0, 0, 3, 2])
    top_p = torch.tensor([1.0, 0.9, 1.0, 1.0, 1.0, 0.5])

    def gens():
        return [torch.Generator().manual_seed(10 + i) for i in range(6)]

    res = verify(drafts, lengths, logits, temperature, top_k, top_p, None, dists, gens())
    greedy_rows, sampled_rows = [0, 2, 5], [1, 3, 4]
    g = greedy_verify(drafts[greedy_rows], lengths[greedy_rows], logits[greedy_rows])
    probs = probs_from_logits(
        logits[sampled_rows], temperature[sampled_rows], top_k[sampled_rows], top_p[sampled_rows]
    )
    all_gens = gens()
    s = rejection_verify(
        drafts[sampled_rows],
        lengths[sampled_rows],
        None,
        dists[sampled_rows],
        probs,
        [all_gens[i] for i in sampled_rows],
    )
    assert res.num_accepted[greedy_rows].tolist() == g.num_accepted.tolist()
    assert res.next_tokens[greedy_rows].tolist() == g.next_tokens.tolist()
    assert res.num_accepted[sampled_rows].tolist() == s.num_accepted.tolist()
    assert res.next_tokens[sampled_rows].tolist() == s.next_tokens.tolist()
    # sampled rows respect top-k: the emitted token is within the row's top-k at that position
    for row, kk in ((1, 4), (4, 3)):
        pos = res.num_accepted[row].item()
        assert res.next_tokens[row].item() in logits[row, pos].topk(kk).indices.tolist()


def test_verify_all_greedy_and_all_sampled_scalars():
    drafts, lengths, dists, _ = random_case(4, 2, seed=3)
    logits = torch.randn(4, 3, V)
    assert torch.equal(
        verify(drafts, lengths, logits, 0.0).next_tokens,
        greedy_verify(drafts, lengths, logits).next_tokens,
    )
    res = verify(drafts, lengths, logits, 1.0, draft_dists=dists)
    assert (res.num_accepted <= lengths).all()


def test_expected_acceptance_small_formula_and_padding():
    p = torch.tensor([0.5, 0.3, 0.1, 0.1])
    q = torch.tensor([[0.2, 0.5, 0.3, 0.0]])
    ids = torch.tensor([[0, 1, -1]])
    logprobs = torch.tensor([[0.5, 0.3, 0.9]]).log()
    # min(0.5, 0.2) + min(0.3, 0.5); the padded slot is ignored
    assert expected_acceptance(ids, logprobs, q).item() == pytest.approx(0.5)
    full = expected_acceptance(torch.arange(4)[None], p.log()[None], q)
    assert full.item() == pytest.approx(0.2 + 0.3 + 0.1 + 0.0)
    assert expected_acceptance(ids, logprobs, q) <= full  # lower bound
