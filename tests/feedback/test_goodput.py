import dataclasses

import numpy as np
import pytest

from feedback.goodput import (
    AcceptanceEstimate,
    CostModel,
    best_k,
    expected_tokens,
    expected_tokens_from_confidence,
)


def test_expected_tokens_geometric_series():
    assert expected_tokens(0.0, 4) == 1.0
    assert abs(expected_tokens(0.5, 2) - 1.75) < 1e-9
    assert abs(expected_tokens(1.0, 4) - 5.0) < 1e-4


def test_confidence_expectation_matches_geometric_when_constant():
    conf = np.full((2, 4), 0.6)
    e = expected_tokens_from_confidence(conf)
    assert e.shape == (2, 5)
    assert np.allclose(e[0], [expected_tokens(0.6, k) for k in range(5)])


def test_speculation_turns_off_when_drafts_are_useless_or_expensive():
    cheap = CostModel(target_step_ms=37.6, draft_ms_per_token=0.05)
    assert best_k(0.0, 8, cheap) == 0
    assert best_k(0.9, 8, cheap) == 8
    pricey = CostModel(target_step_ms=37.6, draft_ms_per_token=30.0)
    assert best_k(0.5, 8, pricey) == 0
    mid = CostModel(target_step_ms=37.6, draft_ms_per_token=5.0)
    assert 0 < best_k(0.6, 8, mid) < 8


def test_costs_and_acceptance_are_learned_online():
    costs = CostModel(ema=1.0)
    costs.observe_verify(0, 10.0)
    costs.observe_verify(4, 20.0)
    assert costs.target_step_ms == 10.0 and costs.verify_ms(4) == 20.0
    costs.observe_draft(4, 8.0)
    assert costs.draft_ms_per_token == 2.0
    est = AcceptanceEstimate(value=0.5, ema=1.0)
    est.observe(np.array([4, 4, 0]), np.array([4, 1, 0]))  # 5 successes, 1 failure
    assert abs(est.value - 5 / 6) < 1e-9


def test_hybrid_choice_is_the_rule_both_sides_use():
    from feedback.goodput import hybrid_choice

    g_none = 1.0
    assert hybrid_choice(3, 1.8, 1.5, g_none) == "suffix"  # a confident suffix draft is kept
    assert hybrid_choice(3, 1.2, 1.5, g_none) == "learned"  # the learned draft promises more
    assert hybrid_choice(0, g_none, 1.5, g_none) == "learned"  # no suffix match
    assert hybrid_choice(0, g_none, 0.9, g_none) == "none"  # nothing pays: plain decoding
    assert hybrid_choice(2, 0.95, 0.9, g_none) == "none"  # a suffix draft that does not pay
    assert hybrid_choice(2, 0.95, 0.0, g_none) == "none"  # no learned drafter, still not worth it


def test_gate_and_hybrid_drafter_import_the_same_rule():
    from feedback import goodput
    from serving.drafters import hybrid
    from trainer import gate

    assert hybrid.hybrid_choice is goodput.hybrid_choice is gate.hybrid_choice
    assert hybrid.learned_goodput is goodput.learned_goodput is gate.learned_goodput


def test_a_weak_prior_gives_way_to_the_first_observations():
    drafted, nothing = np.array([2]), np.array([0])
    ema_only, weak = AcceptanceEstimate(), AcceptanceEstimate(prior_weight=1.0)
    for _ in range(3):
        ema_only.observe(drafted, nothing)
        weak.observe(drafted, nothing)
    assert ema_only.value > 0.4  # an EMA from the prior still believes half the drafts land
    assert weak.value < 0.15  # three steps of evidence outweigh a prior worth one
    for _ in range(200):
        weak.observe(np.array([2]), np.array([2]))
    assert weak.value > 0.95  # and it becomes the EMA once the evidence is long


def test_an_observation_after_idle_steps_weighs_as_the_aged_evidence_allows():
    """Steps that drafted nothing age what the estimate knows (``idle_decay``): after G of them the
    next observation weighs 1 / (1 + (1/ema - 1) x decay^G) instead of ema."""
    drafted, nothing, none = np.array([1]), np.array([0]), np.array([0])

    def settled(decay):
        est = AcceptanceEstimate(value=0.4, idle_decay=decay)  # an EMA: weight 0.05 a step
        for _ in range(100):
            est.observe(none, none)  # 100 plain steps
        est.observe(drafted, nothing)  # one failed probe
        return est.value

    held = 19 * 0.99**100
    assert settled(1.0) == pytest.approx(0.4 * 0.95)  # without aging: one EMA step
    assert settled(0.99) == pytest.approx(0.4 * held / (held + 1))  # ~0.12 of a weight
    est = AcceptanceEstimate(value=0.4, idle_decay=0.99)
    est.observe(none, none)
    est.observe(drafted, nothing)
    est.observe(drafted, nothing)  # no idle step before it: an EMA step again
    after_one_idle = 0.4 * (19 * 0.99) / (19 * 0.99 + 1)
    assert est.value == pytest.approx(after_one_idle * 0.95)


def test_what_one_more_drafted_token_costs_is_measured_apart_from_the_price_per_token():
    """A suffix index's lookup on a 2-core EPYC: ~0.47 ms a draft + ~0.02 ms a token. Per token
    (ms / n) a draft of 8 looked like ~1 ms; one more token adds ~0.02 ms."""
    costs = CostModel()
    for i in range(200):
        n = 1 + i % 8
        costs.observe_draft(n, 0.47 + 0.02 * n)
    assert costs.draft_ms_marginal == pytest.approx(0.02, abs=0.002)
    assert costs.draft_ms_per_token > 0.1  # the price a learned drafter's k is still chosen on


def test_a_drafts_marginal_cost_is_its_price_per_token_where_its_length_never_varies():
    costs = CostModel()
    assert costs.draft_ms_marginal == costs.draft_ms_per_token  # the prior, before any draft
    for _ in range(50):
        costs.observe_draft(1, 3.0)
    assert costs.draft_ms_marginal == pytest.approx(3.0)
    assert costs.draft_ms(2) == pytest.approx(6.0)


def test_one_spiked_draft_counts_at_most_twice_what_such_a_draft_costs():
    costs = CostModel()
    for n, ms in ((4, 4.55), (3, 3.65), (2, 2.57), (2, 2.76), (2, 2.30)):
        costs.observe_draft(n, ms)
    spiked, twice = dataclasses.replace(costs), dataclasses.replace(costs)
    spiked.observe_draft(2, 13.55)
    twice.observe_draft(2, costs._spike_cap(2))
    assert spiked.draft_ms_marginal == twice.draft_ms_marginal
    assert spiked.draft_ms(2) == twice.draft_ms(2) and costs._spike_cap(2) < 13.55


def test_a_real_rise_in_a_drafts_price_is_followed():
    costs = CostModel()
    for _ in range(20):
        costs.observe_draft(2, 2.5)
    for _ in range(40):  # a drafter three times as dear (a swap, a slow period)
        costs.observe_draft(2, 7.5)
    assert costs.draft_ms(2) == pytest.approx(7.5, rel=0.05)


def test_drafts_longer_and_cheaper_at_once_add_nothing_per_token_rather_than_less_than_nothing():
    """A hybrid's learned drafts are short and dear, its suffix drafts long and cheap: the line
    through them slopes down."""
    costs = CostModel()
    for i in range(100):
        costs.observe_draft(*((1, 3.0) if i % 2 else (8, 0.5)))
    assert costs.draft_ms_marginal == 0.0
