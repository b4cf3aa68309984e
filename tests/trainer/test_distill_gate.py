import copy
import dataclasses
import math

import numpy as np
import pytest
import torch
from trainer_tracegen import make_trace, tiny_lm

from kernels.cpu import native_bf16
from trainer.distill import DistillConfig, Distiller, autocast_bf16
from trainer.gate import GateConfig, build_suffix_index, judge, loss_healthy, score
from trainer.students import StandaloneStudent

CFG = GateConfig(k=3, hybrid=False)  # learned alone: see trainer_tracegen.NOT_SUFFIX_TEXT


def test_distillation_raises_heldout_acceptance(trained_student):
    _, res = trained_student
    before = res.curve[0]["expected_acceptance"]
    assert res.best_acceptance > before + 0.3
    assert all(math.isfinite(x) for x in res.losses)


def test_gate_promotes_a_better_candidate_and_refuses_a_worse_one(trained_student, domain_a_replay):
    good, res = trained_student
    fresh = StandaloneStudent(tiny_lm(seed=5))
    suffix = build_suffix_index(domain_a_replay.train_records)
    up = judge(good, fresh, domain_a_replay.heldout, CFG, suffix=suffix, losses=res.losses)
    assert up.promote, up.reason
    assert up.candidate.sim_speedup > up.champion.sim_speedup
    down = judge(fresh, good, domain_a_replay.heldout, CFG, suffix=suffix, losses=[1.0, 0.9])
    assert not down.promote and "expected acceptance" in down.reason


def test_gate_refuses_equal_candidate_within_margin(trained_student, domain_a_replay):
    good, _ = trained_student
    twin = StandaloneStudent(copy.deepcopy(good.model))
    assert not judge(twin, good, domain_a_replay.heldout, CFG).promote


def test_gate_refreshes_a_champion_live_long_enough_with_a_candidate_no_worse(trained_student, domain_a_replay):
    """Small updates promoted often: a candidate that only matches the champion is promoted once
    the champion has been live refresh_after_s, never before, and a worse one never."""
    good, _ = trained_student
    twin = StandaloneStudent(copy.deepcopy(good.model))
    young = judge(twin, good, domain_a_replay.heldout, CFG, champion_age_s=CFG.refresh_after_s - 1)
    assert not young.promote
    old = judge(twin, good, domain_a_replay.heldout, CFG, champion_age_s=CFG.refresh_after_s + 1)
    assert old.promote and old.reason.startswith("refresh")
    worse = judge(StandaloneStudent(tiny_lm(seed=5)), good, domain_a_replay.heldout, CFG,
                  champion_age_s=CFG.refresh_after_s * 10)
    assert not worse.promote
    off = dataclasses.replace(CFG, refresh_after_s=None)
    assert not judge(twin, good, domain_a_replay.heldout, off, champion_age_s=1e6).promote
    # with no learned champion the candidate must beat suffix-only as before, whatever the age
    assert not judge(twin, None, domain_a_replay.heldout, CFG, champion_age_s=1e6).reason.startswith("refresh")


def test_gate_refuses_nan_weights_and_diverged_loss(trained_student, domain_a_replay):
    good, _res = trained_student
    broken = StandaloneStudent(copy.deepcopy(good.model))
    with torch.no_grad():
        next(broken.model.parameters()).view(-1)[0] = float("nan")
    d = judge(broken, None, domain_a_replay.heldout, CFG)
    assert not d.promote and "non-finite weights" in d.reason
    inf = StandaloneStudent(copy.deepcopy(good.model))
    with torch.no_grad():
        next(inf.model.parameters()).view(-1)[0] = float("inf")
    assert not judge(inf, None, domain_a_replay.heldout, CFG).promote
    assert not judge(good, None, domain_a_replay.heldout, CFG, losses=[1.0, float("nan")]).promote
    assert not loss_healthy([1.0, 0.5, 0.4] + [50.0] * 3)
    assert loss_healthy([1.0, 0.5, 0.4, 0.41])
    # Online batches are noisy and a domain shift raises the loss for a while: not a divergence.
    noisy = [0.1, 0.9] * 45 + [1.6] * 10  # min 0.1, recent mean 1.6 (16x the min, 3.2x the median)
    assert loss_healthy(noisy)


def test_learned_acceptance_is_domain_specific(trained_student):
    good, _ = trained_student
    a = [make_trace("a", seed=1000 + i) for i in range(8)]
    b = [make_trace("b", seed=1000 + i) for i in range(8)]
    assert score(good, a, CFG, None).expected_acceptance > score(good, b, CFG, None).expected_acceptance + 0.3


def test_every_loss_kind_trains(domain_a_replay):
    for kind in ("fkl", "rkl", "jsd", "tvd"):
        st = StandaloneStudent(tiny_lm(seed=1))
        d = Distiller(st, DistillConfig(loss=kind, lr=3e-3, ce_weight=0.1, eval_every=10, patience=10))
        before = d.evaluate(domain_a_replay.heldout, 3)["expected_acceptance"]
        d.fit(domain_a_replay, 20, k=3)
        after = d.evaluate(domain_a_replay.heldout, 3)["expected_acceptance"]
        assert after > before + 0.05, kind


def test_checkpoint_round_trip_resumes_identically(domain_a_replay):
    cfg = DistillConfig(lr=3e-3)
    a = Distiller(StandaloneStudent(tiny_lm(seed=2)), cfg)
    for _ in range(3):
        a.step(domain_a_replay.sample(4, a.rng))
    state = copy.deepcopy(a.state_dict())
    b = Distiller(StandaloneStudent(tiny_lm(seed=9)), cfg)
    b.load_state_dict(state)
    la = a.step(domain_a_replay.sample(4, a.rng))["loss"]
    lb = b.step(domain_a_replay.sample(4, b.rng))["loss"]
    assert la == lb
    for x, y in zip(a.student.model.parameters(), b.student.model.parameters()):
        assert torch.equal(x, y)


def test_gate_simulates_each_domain_at_its_own_acceptance(trained_student, domain_a_replay):
    """Serving's live acceptance follows the traffic, so a drafter that learned domain a is judged
    on a's requests at a's rate, not at a rate diluted by domain b's: the mixed score is exactly
    the per-domain scores combined."""
    good, _ = trained_student
    cfg = GateConfig(k=3, hybrid=False, verify_cost=1.7, draft_cost=0.088)  # this CPU's costs
    on_a = domain_a_replay.heldout
    on_b = [make_trace("b", seed=1000 + i) for i in range(len(on_a))]
    sa, sb, mixed = score(good, on_a, cfg, None), score(good, on_b, cfg, None), score(good, on_a + on_b, cfg, None)
    tokens_a = sum(len(r.output_ids) for r in on_a)
    tokens_b = sum(len(r.output_ids) for r in on_b)
    combined = (tokens_a + tokens_b) / (tokens_a / sa.sim_speedup + tokens_b / sb.sim_speedup)
    assert mixed.sim_speedup == pytest.approx(combined, rel=1e-9)
    assert sa.sim_speedup > 1.0  # the learned domain pays on its own


def test_bf16_autocast_trains_and_keeps_fp32_weights(domain_a_replay):
    """bf16 autocast rounds the step's matmul inputs only: the first loss moves a little off
    fp32's, the weights and optimizer stay fp32, and training still raises held-out acceptance."""
    recs = domain_a_replay.sample(4, np.random.default_rng(0))
    losses = {}
    for precision in ("fp32", "bf16"):
        d = Distiller(StandaloneStudent(tiny_lm(seed=1)), DistillConfig(lr=3e-3, precision=precision))
        assert d.bf16 == (precision == "bf16")
        assert d.train_precision == precision
        losses[precision] = d.step(recs)["loss"]
        assert all(p.dtype == torch.float32 for p in d.student.model.parameters())
    assert losses["bf16"] != losses["fp32"] and abs(losses["bf16"] - losses["fp32"]) < 0.05 * losses["fp32"]

    d = Distiller(StandaloneStudent(tiny_lm(seed=1)), DistillConfig(lr=3e-3, precision="bf16", eval_every=10))
    before = d.evaluate(domain_a_replay.heldout, 3)["expected_acceptance"]
    res = d.fit(domain_a_replay, 30, k=3)
    assert res.best_acceptance > before + 0.05 and all(math.isfinite(x) for x in res.losses)


def test_training_precision_is_bf16_only_where_native_or_asked():
    cpu = torch.device("cpu")
    assert autocast_bf16("bf16", cpu) and not autocast_bf16("fp32", cpu)
    assert autocast_bf16("auto", cpu) == native_bf16()
    with pytest.raises(ValueError, match="precision"):
        autocast_bf16("fp16", cpu)


def test_a_refresh_that_predicts_better_may_simulate_slightly_slower():
    """The hybrid simulation reads a better learned drafter a little slow (it charges every draft
    its flat-rate choice asks for): a refresh with higher expected acceptance passes within the
    slack of the champion's simulated speedup, never beyond it, and never without predicting
    better by the margin."""
    from trainer.gate import DrafterScore, refresh_reason

    cfg = GateConfig(acceptance_margin=0.005, refresh_speedup_slack=0.01)
    champ = DrafterScore(expected_acceptance=0.19, sim_accept_len=1.2, sim_speedup=1.600)

    def score(acceptance, speedup):
        return DrafterScore(expected_acceptance=acceptance, sim_accept_len=1.2, sim_speedup=speedup)

    assert refresh_reason(score(0.19, 1.600), champ, cfg).startswith("candidate no worse")
    assert refresh_reason(score(0.22, 1.595), champ, cfg).startswith("candidate predicts better")
    assert refresh_reason(score(0.22, 1.580), champ, cfg) is None  # 1.25 % slower: beyond the slack
    assert refresh_reason(score(0.193, 1.595), champ, cfg) is None  # better, but not by the margin
    assert refresh_reason(score(0.18, 1.700), champ, cfg) is None  # predicts worse
    assert refresh_reason(score(0.22, 1.595), champ, dataclasses.replace(cfg, refresh_speedup_slack=0.0)) is None


def _topk_width(record, width: int):
    """``record`` as a replica tracing the target's top-``width`` would have recorded it."""
    s = record.steps
    return record.model_copy(update={"steps": s.model_copy(update={
        "target_topk_ids": s.target_topk_ids[:, :, :width].copy(),
        "target_topk_logprobs": s.target_topk_logprobs[:, :, :width].copy()})})


@pytest.mark.parametrize("kind", ["standalone", "eagle"])
def test_traces_recorded_at_different_topk_widths_train_together(kind):
    """Replicas may trace different top-k widths (a setting changed in a rolling restart): one batch
    of both must train, not fail every round that samples both."""
    if kind == "standalone":
        student, hidden = StandaloneStudent(tiny_lm(seed=0)), 0
    else:
        from trainer_tracegen import VOCAB

        from feedback.drafters.eagle_head import eagle_from_target
        from serving.target import tiny_target
        from trainer.eagle_student import EagleStudent

        target = tiny_target(vocab_size=VOCAB, hidden_size=32, num_layers=3, seed=11)
        student, hidden = EagleStudent(eagle_from_target(target.model, feature_layers=(0, 1, 2), seed=3), depth=2), 96
    records = [make_trace("a", seed=1, hidden=hidden), _topk_width(make_trace("a", seed=2, hidden=hidden), 3)]
    distiller = Distiller(student, DistillConfig(lr=3e-3))
    parts = distiller.step(records)
    assert math.isfinite(parts["loss"]) and distiller.global_step == 1
