"""VerifyCosts: robust per-(batch, width) verify costs for the goodput policy's width choice."""

from serving.engine.verify_costs import VerifyCosts


def test_a_spike_does_not_move_the_plain_cost():
    costs = VerifyCosts()
    for _ in range(10):
        costs.observe(8, 0, 30.0)
    costs.observe(8, 0, 55.0)  # one step hit by a neighbour
    assert costs.plain_ms(8) == 30.0
    assert costs.get(8, 0) == 30.0


def test_a_width_keeps_its_ratio_to_the_plain_step_across_a_slow_period():
    costs = VerifyCosts()
    for _ in range(15):
        costs.observe(4, 0, 20.0)
    for _ in range(3):
        costs.observe(4, 8, 24.0)  # 1.2 plain steps, measured while the machine was fast
    assert costs.get(4, 8) == 24.0
    for _ in range(15):
        costs.observe(4, 0, 22.0)  # every step 10 % slower now
    assert abs(costs.get(4, 8) - 22.0 * 1.2) < 1e-9
    assert costs.measured(4) == {0: 22.0, 8: costs.get(4, 8)}


def test_batch_sizes_are_kept_apart_and_unmeasured_widths_are_unknown():
    costs = VerifyCosts()
    costs.observe(1, 0, 10.0)
    costs.observe(1, 4, 11.0)
    assert costs.get(8, 0) is None and costs.get(1, 2) is None
    assert costs.measured(8) == {}
    assert costs.measured(1) == {0: 10.0, 4: 11.0}


def test_a_width_measured_before_any_plain_step_uses_its_own_median():
    costs = VerifyCosts()
    for ms in (12.0, 40.0, 13.0):
        costs.observe(2, 4, ms)
    assert costs.get(2, 4) == 13.0
