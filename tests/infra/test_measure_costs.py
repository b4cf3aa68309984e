"""The gate's costs are measured on the paths serving runs (ModelRunner, the learned drafter's propose)."""

import torch

from infra.costs import measure_costs
from infra.day0 import make_student
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


def test_a_cost_is_the_median_of_paired_ratios_whatever_the_drift(monkeypatch):
    """The machine slows down as it goes (each call 10 % slower than the last) and ``fn`` does
    twice ``base``'s work: every pair reads 2 x 1.1 (``fn`` runs right after ``base``), at the
    start of the run as at its end, where a ratio of two medians taken one after the other reads
    the drift between them."""
    from infra import measure

    clock = [0.0]
    cost = [1.0]

    def run(times):
        def call():
            clock[0] += times * cost[0]
            cost[0] *= 1.1
        return call

    monkeypatch.setattr(measure.time, "perf_counter", lambda: clock[0])
    ratio = measure.median_ratio(run(2.0), run(1.0), iters=9, warmup=1)
    assert abs(ratio - 2.2) < 1e-9
    apart = measure.median_ms(run(2.0), iters=9, warmup=1) / measure.median_ms(run(1.0), iters=9, warmup=1)
    assert apart < 1.0  # fn read cheaper than base, though it does twice the work: base ran later
