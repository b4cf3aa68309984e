"""The gate drafts the learned drafter at the length serving's hybrid would, and charges it as
serving's cost model does."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from trainer.gate import GateConfig, learned_length, relative_costs, simulate

CPU = GateConfig(k=4, verify_cost=1.7, draft_cost=0.088, branches=1)  # measured on this 2-core CPU, 1 thread; chains


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
        version, feature_layers, kind, branches = "x", (), "standalone", CPU.branches

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


def test_hybrid_rate_is_measured_on_the_steps_the_learned_drafter_gets():
    """A learned drafter right exactly where the suffix index is confident (a repeated output) and
    wrong on the novel half: over every position it looks good, but the hybrid gives it only the
    novel steps, where serving would measure ~0 and stop drafting it. The gate's rate follows."""
    from trainer_tracegen import make_trace

    from trainer.gate import build_suffix_index, hybrid_acceptance
    from trainer.students import RecordEval

    seen = make_trace("a", seed=1, out_len=40)
    novel = np.random.default_rng(7).integers(1000, 2000, size=40)
    rec = seen.model_copy(update={"request_id": "held", "domain": "code", "output_ids": np.concatenate(
        [seen.output_ids, novel])}, deep=True)
    proposer = build_suffix_index([seen])
    cfg = GateConfig(k=4, verify_cost=1.2, draft_cost=0.05)
    accept_at = np.concatenate([np.full(40, 4), np.zeros(40, dtype=np.int64)])  # right, then wrong
    everywhere = {"code": 0.5}
    rates = hybrid_acceptance([rec], [RecordEval(np.zeros(0), accept_at)], cfg, proposer, everywhere)
    assert rates["code"] < 0.1
    t_all, _, c_all = simulate(rec.output_ids, rec.prompt_ids, accept_at, cfg, proposer, acceptance=0.5)
    t_hyb, _, c_hyb = simulate(rec.output_ids, rec.prompt_ids, accept_at, cfg, proposer, acceptance=rates["code"])
    assert t_hyb / c_hyb > t_all / c_all  # no learned drafts wasted on the novel half


def test_measured_verify_costs_by_width_replace_the_line():
    """On a CPU a forward of 2 tokens costs ~1.2 steps though 5 cost ~1.36: charged along the line
    from 1 to 1.36, one draft token looks cheap enough to pay at acceptance 0.25; charged what it
    costs, it does not (1.25 tokens for 1.29 steps)."""
    line = GateConfig(k=4, verify_cost=1.36, draft_cost=0.08, branches=1)
    measured = GateConfig(k=4, verify_cost=1.36, draft_cost=0.08, verify_costs=(1.21, 1.27, 1.32, 1.36), branches=1)
    assert relative_costs(measured).verify_ms(1) == pytest.approx(1.21)
    assert relative_costs(line).verify_ms(1) == pytest.approx(1.09)
    assert learned_length(0.25, line) == 1
    assert learned_length(0.25, measured) == 0


def test_a_tree_adds_the_runner_up_where_the_chain_was_refused():
    from trainer.students import tree_run_lengths

    match = np.array([1, 1, 0, 1, 0, 0], dtype=bool)  # the greedy chain's token is the target's
    in_top = np.array([1, 1, 1, 0, 0, 1], dtype=bool)  # the target's token is among the candidates
    assert tree_run_lengths(match, in_top, 4).tolist() == [3, 2, 1, 1, 0, 1]
    assert tree_run_lengths(match, in_top, 2).tolist() == [2, 2, 1, 1, 0, 1]  # no runner-up past the depth


def test_a_path_that_ends_on_a_runner_up_refused_nothing():
    """Serving's trials (``tree_trial``): a path that ends on a runner-up, a leaf, is all
    successes; the gate counted it a refusal too, and underrated every tree drafter against the
    suffix index it is compared with."""
    from serving.drafters.draft_tree import tree_trial
    from trainer.gate import learned_acceptance
    from trainer.students import tree_runs

    match = np.array([1, 1, 0, 1, 0, 0], dtype=bool)
    in_top = np.array([1, 1, 1, 0, 0, 1], dtype=bool)
    accept_at, leaf_end = tree_runs(match, in_top, 4)
    assert leaf_end.tolist() == [True, True, True, False, False, True]
    # [3, 2, 1, 1, 0, 1]: 8 accepted; refused only where the path ended on the chain (positions 3, 4)
    assert learned_acceptance([accept_at], 4, [leaf_end]) == pytest.approx(8 / 10)
    assert learned_acceptance([accept_at], 4) == pytest.approx(8 / 14)  # every short path a refusal
    # serving's count of the same two kinds of step: a chain of 4 with a runner-up at every level
    tokens, parents = [10, 11, 12, 13, 20, 21, 22, 23], [-1, 0, 1, 2, -1, 0, 1, 2]
    assert tree_trial(tokens, parents, [10, 21, 99]) == (2, 2)  # ended on a runner-up: no refusal
    assert tree_trial(tokens, parents, [10, 99]) == (2, 1)  # the chain refused at level 2


def test_the_hybrid_simulation_counts_no_refusal_at_a_runner_up():
    output = np.arange(40)
    accept_at = np.ones(40, dtype=np.int64)  # one token accepted from every position...
    ends = np.ones(40, dtype=bool)  # ...each a runner-up
    cfg = GateConfig(k=4, verify_cost=1.2, draft_cost=0.05)
    leaf, chain = [0.0, 0.0], [0.0, 0.0]
    simulate(output, output[:4], accept_at, cfg, None, acceptance=0.5, length=2, learned_steps=leaf, leaf_end=ends)
    simulate(output, output[:4], accept_at, cfg, None, acceptance=0.5, length=2, learned_steps=chain)
    assert leaf[1] == 0 and chain[1] == chain[0] > 0


def test_a_student_scored_with_candidates_accepts_at_least_its_chain():
    from trainer_tracegen import make_trace, tiny_lm

    from trainer.students import StandaloneStudent

    student = StandaloneStudent(tiny_lm(seed=3))
    rec = make_trace("r", seed=2, out_len=30)
    chain = student.evaluate(rec, 4).accept_at
    tree = student.evaluate(rec, 4, branches=2).accept_at
    everything = student.evaluate(rec, 4, branches=10_000).accept_at  # every token a candidate
    assert (tree >= chain).all() and (tree <= np.minimum(chain + 1, 4)).all()
    assert (everything == np.minimum(chain + 1, 4))[: len(chain) - 4].all()


def test_a_tree_draft_is_charged_the_verify_of_its_nodes():
    """One drafted position with its runner-up verifies two nodes: the length is chosen, and each
    step charged, at that width (a chain of one would be charged one)."""
    tree = replace(CPU, branches=2, verify_costs=(1.05, 1.1, 1.15, 1.2))
    assert learned_length(0.35, tree) == 1
    output = np.arange(60)
    accept_at = np.where(np.arange(60) % 2 == 0, 1, 0)
    _, steps, cost = simulate(output, output[:4], accept_at, tree, None, acceptance=0.35)
    assert cost == pytest.approx(steps * (relative_costs(tree).verify_ms(2) + tree.draft_cost))
    assert learned_length(0.35, replace(tree, verify_costs=(1.05, 1.4, 1.45, 1.5))) == 0  # two nodes too dear


def test_an_eagle_student_scored_with_candidates_accepts_at_least_its_chain():
    """The EAGLE head's trees are scored as serving drafts them: a runner-up is a leaf, read from
    the refused position's logits, so it adds at most one token to the chain's run."""
    from trainer_tracegen import VOCAB, make_trace

    from feedback.drafters.eagle_head import eagle_from_target
    from serving.target import tiny_target
    from trainer.eagle_student import EagleStudent

    target = tiny_target(vocab_size=VOCAB, hidden_size=32, num_layers=3, seed=11)
    layers = (0, 1, 2)
    head = eagle_from_target(target.model, feature_layers=layers, init="random", seed=3)
    student = EagleStudent(head, depth=4)
    rec = make_trace("r", seed=2, out_len=30, hidden=32 * len(layers))
    chain = student.evaluate(rec, 4).accept_at
    tree = student.evaluate(rec, 4, branches=2).accept_at
    everything = student.evaluate(rec, 4, branches=10_000).accept_at  # every token a candidate
    assert (tree >= chain).all() and (tree <= np.minimum(chain + 1, 4)).all()
    scored = chain < 4  # positions where a refused level exists within the depth...
    scored[-4:] = False  # ...and the trace goes on past it
    assert scored.any() and (everything[scored] == chain[scored] + 1)[2:].all()
