"""The gate drafts the learned drafter at the length serving's hybrid would, and charges it as
serving's cost model does."""

from __future__ import annotations

import numpy as np
import pytest

from trainer.gate import GateConfig, learned_length, relative_costs, simulate

CPU = GateConfig(k=4, verify_cost=1.7, draft_cost=0.088)  # measured on this 2-core CPU, 1 thread


@pytest.mark.parametrize("acceptance, cfg, length", [
    (0.35, CPU, 1),  # 1.35 tokens / 1.26 steps pays; 4 drafts (1.53 / 2.05) lose
    (0.05, CPU, 0),  # nothing pays: plain decoding
    (0.35, GateConfig(k=4, verify_cost=1.0, draft_cost=0.0), 4),  # free drafts and verifies: all k
])
def test_learned_length_is_the_goodput_best(acceptance, cfg, length):
    assert learned_length(acceptance, cfg) == length


def test_learned_length_matches_serving_hybrid():
    from serving.drafters.hybrid import HybridDrafter, HybridPolicy

    class Nothing:
        version, feature_layers, kind = "x", (), "standalone"

    for acceptance in (0.05, 0.2, 0.35, 0.6, 0.9):
        hybrid = HybridDrafter(Nothing(), Nothing(), HybridPolicy(prior_acceptance=acceptance, target_step_ms=1.0,
                                                                   draft_ms_per_step=CPU.draft_cost))
        hybrid.costs.verify_slope = relative_costs(CPU).verify_slope
        assert hybrid.learned_length(CPU.k) == learned_length(acceptance, CPU), acceptance


def test_simulation_charges_the_short_learned_draft():
    output = np.arange(60)
    accept_at = np.where(np.arange(60) % 2 == 0, 2, 0)  # the k-chain matches 2 tokens at every other position
    tokens, steps, cost = simulate(output, output[:4], accept_at, CPU, None, acceptance=0.35)
    per_step = relative_costs(CPU).verify_ms(1) + CPU.draft_cost
    assert cost == pytest.approx(steps * per_step)
    assert tokens / cost > 1.0  # pays at length 1 ...
    t4, _, c4 = simulate(output, output[:4], accept_at, CPU, None, acceptance=0.35, length=4)
    assert t4 / c4 < tokens / cost  # ... better than drafting all 4
