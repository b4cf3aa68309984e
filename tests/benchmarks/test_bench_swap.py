"""bench swap's stall arithmetic on synthetic step clocks."""

from benchmarks.bench_swap import _null_stalls, _stall_ms, _window_stalls


def _clock(gaps_ms, switch_at):
    """Steps with the given gaps (ms); drafter 'b' from step ``switch_at`` on."""
    steps, t = [], 0.0
    for i, g in enumerate(gaps_ms):
        t += g / 1000.0
        steps.append((t, "b" if i >= switch_at else "a", 4))
    return steps


def test_a_slow_step_after_the_swap_is_its_stall_and_quiet_windows_read_zero():
    gaps = [0.0] + [50.0] * 9 + [80.0] + [50.0] * 30  # the step at index 10 is the new drafter's
    steps = _clock(gaps, switch_at=10)
    called = steps[9][0]  # the swap is called right after step 9
    installs, base = _stall_ms(steps, gaps)
    assert base == 50.0 and installs == [30.0]
    assert _window_stalls(steps, gaps, base, [called], None) == [30.0]
    nulls = _null_stalls(steps, gaps, base, [called], [steps[5][0]])
    assert nulls and all(n == 0.0 for n in nulls)


def test_quiet_windows_see_the_noise_of_ordinary_steps():
    gaps = [0.0] + [50.0] * 9 + [50.0] + [50.0, 70.0] * 15
    steps = _clock(gaps, switch_at=10)
    nulls = _null_stalls(steps, gaps, 50.0, [steps[9][0]], [steps[5][0]])
    assert 10.0 < max(nulls) <= 20.0  # a window inside a 70 ms step reads its share of 20 ms
