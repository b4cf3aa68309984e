"""ProbeSchedule: probes of a drafter that is off come every interval, at once for a new drafter,
and are spaced by what they were measured to cost."""

import pytest

from feedback.goodput import CostModel
from serving.engine.probes import ProbeSchedule


def test_a_probe_comes_every_interval_and_at_once_for_a_new_drafter():
    probes = ProbeSchedule(every=4, k=2, budget=0.01)
    due = [probes.due(interval=5, costly=True) for _ in range(15)]
    assert [i for i, d in enumerate(due) if d] == [4, 9, 14] and probes.count == 3
    probes.restart()
    assert probes.due(interval=5, costly=False) and not probes.costly_now  # no wait for a new one
    with pytest.raises(ValueError):
        ProbeSchedule(every=0, k=2, budget=0.01)
    with pytest.raises(ValueError):
        ProbeSchedule(every=4, k=2, budget=0.0)


def test_probes_are_spaced_by_what_they_cost():
    costs = CostModel(target_step_ms=10.0, verify_slope=0.0, draft_ms_per_token=5.0)
    probes = ProbeSchedule(every=4, k=1, budget=0.01)
    assert probes.costly_interval(costs) == 50  # 5 ms of draft, 1 % of 10 ms steps
    probes.due(interval=1, costly=True)
    probes.observe_cost(draft_ms=20.0, verify_ms=12.0, plain_ms=10.0)  # a catch-up made it dear
    assert probes.cost_ms == pytest.approx(22.0) and not probes.costly_now
    assert probes.costly_interval(costs) == 220
    probes.observe_cost(draft_ms=1.0, verify_ms=10.0, plain_ms=10.0)  # no probe this step
    assert probes.cost_ms == pytest.approx(22.0)
    assert probes.cheap_interval(0.5) == 50 and probes.cheap_interval(0.01) == 4  # at least every
