"""The trainer re-scores the same weights on the same held-out traces (a fit's first evaluation,
the gate's candidate and champion): those answers are remembered per weights, and only those."""

import copy

import numpy as np
from trainer_tracegen import make_trace, tiny_lm

from trainer.distill import DistillConfig, Distiller
from trainer.gate import GateConfig, score
from trainer.replay import ReplayBuffer
from trainer.students import StandaloneStudent

CFG = GateConfig(k=3, hybrid=False)


class CountingStudent(StandaloneStudent):
    def __init__(self, model):
        super().__init__(model)
        self.evaluated = 0

    def evaluate(self, record, k, branches=1):
        self.evaluated += 1
        return super().evaluate(record, k, branches)


def _records(n, seed0=0):
    return [make_trace("a", seed=seed0 + i) for i in range(n)]


def test_same_weights_same_traces_are_evaluated_once():
    st = CountingStudent(tiny_lm(seed=3))
    held = _records(6)
    first = score(st, held, CFG, None)
    assert st.evaluated == 6
    again = score(st, held, CFG, None)
    assert st.evaluated == 6 and again == first
    score(st, held + _records(1, seed0=100), CFG, None)  # a new held-out trace: only it
    assert st.evaluated == 7
    score(st, held, GateConfig(k=2, hybrid=False), None)  # another k is another answer
    assert st.evaluated == 13


def test_a_weight_change_misses_and_a_restore_hits():
    st = CountingStudent(tiny_lm(seed=3))
    held = _records(5)
    before = score(st, held, CFG, None)
    saved = copy.deepcopy(st.model.state_dict())
    d = Distiller(st, DistillConfig(lr=3e-2, precision="fp32"))
    d.step(_records(4, seed0=50))
    trained = score(st, held, CFG, None)
    assert st.evaluated == 10 and trained.expected_acceptance != before.expected_acceptance
    st.model.load_state_dict(saved)  # e.g. a fit restoring its best-on-held-out weights
    assert score(st, held, CFG, None) == before and st.evaluated == 10


def test_cached_scores_equal_fresh_ones_and_copies_keep_their_own():
    st = CountingStudent(tiny_lm(seed=4))
    held = _records(5)
    d = Distiller(st, DistillConfig(lr=3e-3, eval_every=5, precision="fp32"))
    rb = ReplayBuffer(heldout_fraction=0.0)
    rb.extend(_records(20, seed0=200))
    for r in held:
        rb.add(r, heldout=True)
    d.fit(rb, 10, k=3)
    champion = copy.deepcopy(st)  # what the loop keeps on a promotion
    cached = score(st, held, CFG, None)
    fresh = score(StandaloneStudent(copy.deepcopy(st.model)), held, CFG, None)
    assert cached == fresh
    n = champion.evaluated
    assert score(champion, held, CFG, None) == cached and champion.evaluated == n + len(held)
    d.step(rb.sample(4, np.random.default_rng(0)))  # the student moves on, the champion does not
    assert score(champion, held, CFG, None) == cached and champion.evaluated == n + len(held)
