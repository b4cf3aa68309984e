"""The gate's costs are measured on the paths serving runs (ModelRunner, the learned drafter's propose)."""

import torch

from infra.loop import make_student, measure_costs
from serving.target import tiny_target


def test_costs_are_measured_relative_to_a_target_step():
    target = tiny_target(vocab_size=300, hidden_size=64, num_layers=4)
    student = make_student(target, draft_vocab_size=128)
    before = [t.clone() for t in target.model.state_dict().values()]
    costs = measure_costs(target, student, k=3, context=32)
    assert set(costs) == {"target_step_ms", "verify_cost", "verify_costs", "draft_cost"}
    assert costs["target_step_ms"] > 0 and costs["verify_cost"] > 0 and costs["draft_cost"] > 0
    assert len(costs["verify_costs"]) == 3 and costs["verify_costs"][-1] == costs["verify_cost"]
    # Measuring leaves the target untouched (uncommitted forwards, a copy of the student).
    assert all(torch.equal(a, b) for a, b in zip(before, target.model.state_dict().values()))
