import math

import pytest
import torch
import torch.nn.functional as F

from kernels.losses import (
    discard_loss,
    distill_loss,
    distill_loss_per_position,
    next_token_ce,
    topk_buckets,
)

KINDS = ["fkl", "rkl", "jsd", "tvd"]


def teacher_topk(target_logits: torch.Tensor, t: int):
    logprobs = target_logits.float().log_softmax(-1)
    top = logprobs.topk(t, dim=-1)
    return top.indices, top.values


@pytest.mark.parametrize("renormalise", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_student_equal_to_teacher_gives_zero(kind, renormalise):
    torch.manual_seed(0)
    logits = torch.randn(16, 100) * 3
    ids, lps = teacher_topk(logits, 8)
    loss = distill_loss(logits, ids, lps, kind, renormalise=renormalise)
    assert abs(loss.item()) < 1e-5
    # and a different student is penalised
    assert distill_loss(torch.randn(16, 100), ids, lps, kind, renormalise=renormalise) > 1e-2


def explicit_buckets():
    """V = 5, T = 2: teacher top-2 = ids (3, 0) with probs (0.5, 0.2), tail 0.3."""
    student = torch.tensor([[0.0, 1.0, 2.0, 0.5, -1.0]])
    ids = torch.tensor([[3, 0]])
    lps = torch.tensor([[0.5, 0.2]]).log()
    q = student.softmax(-1)[0]
    q_b = torch.tensor([q[3], q[0], q[1] + q[2] + q[4]])
    p_b = torch.tensor([0.5, 0.2, 0.3])
    return student, ids, lps, p_b, q_b


def test_buckets_include_the_tail():
    student, ids, lps, p_b, q_b = explicit_buckets()
    teacher, student_lp = topk_buckets(student, ids, lps)
    torch.testing.assert_close(teacher[0], p_b)
    torch.testing.assert_close(student_lp[0].exp(), q_b)
    torch.testing.assert_close(student_lp.exp().sum(-1), torch.ones(1))


def test_losses_match_explicit_formulas():
    student, ids, lps, p, q = explicit_buckets()
    m = (p + q) / 2
    expected = {
        "fkl": (p * (p / q).log()).sum(),
        "rkl": (q * (q / p).log()).sum(),
        "jsd": 0.5 * (p * (p / m).log()).sum() + 0.5 * (q * (q / m).log()).sum(),
        "tvd": 0.5 * (p - q).abs().sum(),
    }
    for kind, value in expected.items():
        got = distill_loss(student, ids, lps, kind)
        assert got.item() == pytest.approx(value.item(), rel=1e-5), kind


def test_renormalised_drops_the_tail():
    student, ids, lps, _, _ = explicit_buckets()
    p = torch.tensor([0.5, 0.2]) / 0.7
    q = student[0, [3, 0]].softmax(-1)
    got = distill_loss(student, ids, lps, "fkl", renormalise=True)
    assert got.item() == pytest.approx((p * (p / q).log()).sum().item(), rel=1e-5)


def test_padding_ids_are_ignored():
    torch.manual_seed(1)
    student = torch.randn(3, 20)
    ids, lps = teacher_topk(torch.randn(3, 20), 4)
    padded_ids = torch.cat([ids, torch.full((3, 2), -1)], dim=1)
    padded_lps = torch.cat([lps, torch.full((3, 2), -0.1)], dim=1)  # garbage under the padding
    for kind in KINDS:
        for renorm in (False, True):
            a = distill_loss_per_position(student, ids, lps, kind, renorm)
            b = distill_loss_per_position(student, padded_ids, padded_lps, kind, renorm)
            torch.testing.assert_close(a, b)


def test_padding_does_not_hide_a_real_id_zero():
    student = torch.tensor([[2.0, 0.0, 1.0, -1.0]])
    lps = torch.tensor([[0.6, 0.3, -1.0]]).log()
    with_pad = topk_buckets(student, torch.tensor([[0, 2, -1]]), lps)
    without = topk_buckets(student, torch.tensor([[0, 2]]), lps[:, :2])
    q = student.softmax(-1)[0]
    torch.testing.assert_close(without[1].exp()[0], torch.stack([q[0], q[2], q[1] + q[3]]))
    torch.testing.assert_close(with_pad[1].exp()[0, [0, 1, 3]], without[1].exp()[0])
    assert with_pad[1][0, 2].exp() == 0


def test_teacher_sum_above_one_is_rescaled_not_negative_tail():
    student = torch.zeros(1, 4)
    ids = torch.tensor([[0, 1]])
    lps = torch.tensor([[0.6, 0.41]]).log()  # fp16 rounding can overshoot 1
    teacher, _ = topk_buckets(student, ids, lps)
    assert teacher[0, 2] == 0
    torch.testing.assert_close(teacher.sum(-1), torch.ones(1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", KINDS)
def test_gradients_finite_in_hard_cases(kind, dtype):
    torch.manual_seed(2)
    v = 6
    logits = torch.randn(5, v) * 3
    logits[1] = torch.tensor([80.0, -80.0, 0.0, 0.0, 0.0, 0.0])  # near one-hot student
    ids, lps = teacher_topk(torch.randn(5, v) * 4, 3)
    ids[2] = torch.arange(3)  # teacher ids the student has almost no mass on
    lps[2] = torch.tensor([0.98, 0.01, 0.01]).log()
    ids[3] = -1  # a row that is all padding
    full_ids, full_lps = teacher_topk(torch.randn(5, v), v)  # top-k covers the whole vocabulary
    for row_ids, row_lps in ((ids, lps), (full_ids, full_lps)):
        for renorm in (False, True):
            student = logits.clone().to(dtype).requires_grad_(True)
            loss = distill_loss(
                student, row_ids, row_lps.to(torch.float16), kind, renormalise=renorm
            )
            loss.backward()
            assert loss.dtype == torch.float32 and torch.isfinite(loss)
            assert torch.isfinite(student.grad.float()).all()


def test_weights_give_a_weighted_mean():
    torch.manual_seed(3)
    student = torch.randn(4, 10)
    ids, lps = teacher_topk(torch.randn(4, 10), 3)
    per = distill_loss_per_position(student, ids, lps)
    w = torch.tensor([1.0, 0.0, 3.0, 0.5])
    assert distill_loss(student, ids, lps, weights=w).item() == pytest.approx(
        ((per * w).sum() / w.sum()).item(), rel=1e-6
    )
    assert distill_loss(student, ids, lps).item() == pytest.approx(per.mean().item(), rel=1e-6)


def test_fkl_gradient_moves_student_towards_teacher():
    student, ids, lps, p, _ = explicit_buckets()
    student = student.clone().requires_grad_(True)
    opt = torch.optim.SGD([student], lr=3.0)
    for _ in range(60):
        opt.zero_grad()
        distill_loss(student, ids, lps).backward()
        opt.step()
    _, student_lp = topk_buckets(student.detach(), ids, lps)
    torch.testing.assert_close(student_lp[0].exp(), p, atol=1e-3, rtol=0)


def test_discard_loss_is_unlikelihood_and_lowers_the_rejected_token():
    logits = torch.tensor([[1.0, 2.0, 0.5], [0.0, 0.0, 0.0], [3.0, 0.0, 0.0]], requires_grad=True)
    rejected = torch.tensor([1, 2, -1])
    loss = discard_loss(logits, rejected)
    q = logits.detach().softmax(-1)
    expected = -(0.5 * (torch.log1p(-q[0, 1]) + torch.log1p(-q[1, 2])))
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    loss.backward()
    assert logits.grad[0, 1] > 0 and logits.grad[1, 2] > 0  # descent lowers those logits
    assert torch.equal(logits.grad[2], torch.zeros(3))  # -1 rows ignored


def test_discard_loss_stable_when_q_of_rejected_is_one():
    logits = torch.tensor([[0.0, 60.0, 0.0]], dtype=torch.bfloat16, requires_grad=True)
    loss = discard_loss(logits, torch.tensor([1]), weights=torch.tensor([2.0]))
    loss.backward()
    assert torch.isfinite(loss) and loss.item() == pytest.approx(60 - math.log(2), rel=1e-2)
    assert torch.isfinite(logits.grad.float()).all()
    nothing = discard_loss(logits, torch.tensor([-1]))
    assert nothing.item() == 0.0


def test_next_token_ce_matches_cross_entropy_and_ignores_negative_labels():
    torch.manual_seed(4)
    logits = torch.randn(5, 7)
    labels = torch.tensor([1, 6, -1, 0, 3])
    expected = F.cross_entropy(logits, labels, ignore_index=-1)
    assert next_token_ce(logits, labels).item() == pytest.approx(expected.item(), rel=1e-6)
    w = torch.tensor([1.0, 2.0, 5.0, 0.0, 1.0])
    ce = F.cross_entropy(logits, labels.clamp(min=0), reduction="none")
    keep = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0])
    expected_w = (ce * w * keep).sum() / (w * keep).sum()
    assert next_token_ce(logits, labels, w).item() == pytest.approx(expected_w.item(), rel=1e-6)
