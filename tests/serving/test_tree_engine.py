"""Token-tree speculation end to end: the suffix drafter's trees, the engine verifying them (greedy
token-identical to target-only decoding, batch > 1, ragged; seeded sampled rows identical to
target-only sampling), and the goodput width choice."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from feedback.bus.trace import DrafterKind
from serving.drafters.base import DraftProposal, DraftRequestView
from serving.drafters.suffix import SuffixConfig, SuffixDrafter
from serving.engine.base import GenerationRequest, SamplingParams
from serving.engine.config import EngineConfig
from serving.engine.goodput_policy import GoodputPolicy
from serving.engine.reference import target_greedy_reference
from serving.engine.torch_engine import TorchEngine

PROMPTS = [[1, 2, 3, 4, 5], [7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12], [42, 42, 42], [5, 17]]
VOCAB = 101


def _req(rid, prompt, params):
    return GenerationRequest(request_id=rid, prompt_ids=list(prompt), params=params)


def _tokens(chunks):
    return [t for c in chunks for t in c.token_ids]


@pytest.fixture(scope="module")
def refs(ids_target):
    return {tuple(p): target_greedy_reference(ids_target.model, p, 40) for p in PROMPTS}


class _Stateless:
    """Drafter protocol methods of a drafter that keeps no per-request state."""

    def add_request(self, view, features=None):
        pass

    def on_verified(self, request_id, accepted_ids, features):
        pass

    def remove_request(self, request_id, output_ids):
        pass

    def forget_tenant(self, tenant):
        return False


class TreeReplayDrafter(_Stateless):
    """Proposes trees whose true continuation hides on a random branch: root children are decoys
    and the reference token in a random order, the reference path continues under its node with a
    decoy sibling at each level (and, every ``corrupt_every`` positions, the reference is wrong)."""

    kind = "suffix"
    version = "tree"
    feature_layers = ()

    def __init__(self, references, seed=0, corrupt_every=0):
        self.refs, self.rng, self.corrupt = references, np.random.default_rng(seed), corrupt_every
        self.steps, self.views = [], {}


    def _tree(self, view: DraftRequestView, k: int):
        ref = self.refs.get(tuple(view.token_ids[: view.prompt_len]), [])
        pos = len(view.token_ids) - view.prompt_len
        tokens, parents, conf = [], [], []
        parent = -1
        while len(tokens) + 2 <= k and pos < len(ref):
            true = ref[pos]
            if self.corrupt and pos % self.corrupt == self.corrupt - 1:
                true = (true + 1) % VOCAB
            decoy = (true + 1 + int(self.rng.integers(0, VOCAB - 1))) % VOCAB
            pair = [true, decoy] if self.rng.random() < 0.5 else [decoy, true]
            for t in pair:
                tokens.append(t)
                parents.append(parent)
                conf.append(0.5)
            parent = len(tokens) - 2 + pair.index(true)
            pos += 1
        return tokens, parents, conf

    def propose(self, views, k):
        n = len(views)
        tok = torch.zeros(n, k, dtype=torch.long)
        par = torch.full((n, k), -1, dtype=torch.long)
        conf = torch.zeros(n, k)
        lengths = torch.zeros(n, dtype=torch.long)
        for i, v in enumerate(views):
            t, p, c = self._tree(v, k)
            tok[i, : len(t)] = torch.tensor(t, dtype=torch.long)
            par[i, : len(p)] = torch.tensor(p, dtype=torch.long)
            conf[i, : len(c)] = torch.tensor(c)
            lengths[i] = len(t)
        self.steps.append(int(lengths.max()))
        return DraftProposal(
            tokens=tok,
            lengths=lengths,
            probs=torch.ones(n, k),
            source=np.full(n, DrafterKind.SUFFIX, dtype=np.uint8),
            confidence=conf,
            parents=par,
        )


class Recorder:
    def __init__(self):
        self.steps = []

    def on_step(self, batch):
        self.steps.append(batch)


def _serve_greedy(target, drafter, refs, run):
    """Serve PROMPTS greedily (k = 8, batches of up to 4, staggered arrivals); every output must
    equal target-only decoding. Returns (the step recorder, the outputs)."""
    rec = Recorder()
    engine = TorchEngine(target, drafter, EngineConfig(k=8, max_batch_size=4), [rec])
    reqs = [_req(f"r{i}", p, SamplingParams(max_tokens=40)) for i, p in enumerate(PROMPTS)]
    outs = run(engine, reqs, delays=[0.0, 0.005, 0.01, 0.0, 0.02])
    for p, chunks in zip(PROMPTS, outs):
        assert _tokens(chunks) == refs[tuple(p)]
    return rec, outs


@pytest.mark.parametrize("corrupt_every", [0, 3])
def test_greedy_trees_match_target_only_decoding(ids_target, refs, run, corrupt_every):
    drafter = TreeReplayDrafter(refs, seed=corrupt_every, corrupt_every=corrupt_every)
    rec, outs = _serve_greedy(ids_target, drafter, refs, run)
    mean_accept = np.mean([c[-1].stats.mean_accept_len for c in outs])
    assert mean_accept > (3.0 if corrupt_every == 0 else 1.8)  # branches other than the first won
    trees = [s for s in rec.steps if s.tree_nodes is not None]
    assert trees and max(len(s.request_ids) for s in trees) > 1  # batched tree steps
    for s in trees:  # the chain view: accepted path (+ one rejected node), emitted tokens agree
        for b, (em, a) in enumerate(zip(s.emitted, s.num_accepted)):
            assert list(s.draft_ids[b, :a]) == em[:a]
            assert a <= s.num_drafted[b] <= a + 1 and s.num_drafted[b] <= s.tree_nodes[b]


def test_seeded_sampled_rows_with_trees_equal_target_only(ids_target, refs, run):
    params = SamplingParams(temperature=0.8, max_tokens=32, seed=77)
    [alone] = run(TorchEngine(ids_target, None, EngineConfig(k=0)), [_req("x", PROMPTS[2], params)])
    # the target's own sampled continuation as the hidden branch, in a mixed batch
    sampled_ref = {tuple(PROMPTS[2]): _tokens(alone)}
    drafter = TreeReplayDrafter({**refs, **sampled_ref}, seed=5)
    engine = TorchEngine(ids_target, drafter, EngineConfig(k=6, max_batch_size=4))
    reqs = [
        _req("g0", PROMPTS[0], SamplingParams(max_tokens=40)),
        _req("x", PROMPTS[2], params),
        _req("s1", PROMPTS[3], SamplingParams(temperature=1.0, max_tokens=30)),
    ]
    outs = run(engine, reqs, delays=[0.0, 0.003, 0.0])
    assert _tokens(outs[0]) == refs[tuple(PROMPTS[0])]
    assert _tokens(outs[1]) == _tokens(alone)
    assert outs[1][-1].stats.accepted_tokens > 0


def test_suffix_drafter_proposes_best_first_trees():
    d = SuffixDrafter(SuffixConfig(min_confidence=0.0, tree_branches=4))
    # "1 2" was followed by 3 twice and by 4 once: the tree keeps both branches, 3 first
    ctx = [1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 4, 7, 1, 2]
    view = DraftRequestView("r", ctx, len(ctx))
    d.add_request(view)
    prop = d.propose([view], 6)
    n = int(prop.lengths[0])
    tokens = prop.tokens[0, :n].tolist()
    parents = prop.parents[0, :n].tolist()
    roots = [t for t, p in zip(tokens, parents) if p == -1]
    assert roots[:2] == [3, 4]
    assert all(p < i for i, p in enumerate(parents))
    cum = []  # path probabilities never increase in node order (best-first)
    for i, p in enumerate(parents):
        c = float(prop.confidence[0, i]) * (cum[p] if p >= 0 else 1.0)
        cum.append(c)
    assert all(a >= b - 1e-9 for a, b in itertools.pairwise(cum))


def test_suffix_trees_stay_lossless_and_accept_more(ids_target, refs, run):
    """Greedy suffix trees on repetitive prompts: identical output, no fewer tokens per step."""
    prompts = [p * 4 for p in ([3, 1, 4, 1, 5], [2, 7, 1, 8], [6, 6, 2])]
    ref = {tuple(p): target_greedy_reference(ids_target.model, p, 40) for p in prompts}
    accepts = {}
    for branches in (1, 4):
        drafter = SuffixDrafter(SuffixConfig(tree_branches=branches, min_confidence=0.0))
        engine = TorchEngine(ids_target, drafter, EngineConfig(k=6, max_batch_size=3))
        reqs = [_req(f"r{i}", p, SamplingParams(max_tokens=40)) for i, p in enumerate(prompts)]
        outs = run(engine, reqs)
        for p, chunks in zip(prompts, outs):
            assert _tokens(chunks) == ref[tuple(p)]
        accepts[branches] = sum(c[-1].stats.accepted_tokens for c in outs)
    assert accepts[4] >= accepts[1]


def _chain(n_rows, k, conf):
    parents = torch.cat([torch.full((n_rows, 1), -1), torch.arange(k).expand(n_rows, k)], 1)
    return parents, torch.full((n_rows, k), conf), torch.full((n_rows,), k)


def test_width_follows_measured_costs_and_batch():
    policy = GoodputPolicy(8, remeasure_every=10_000)
    # batch 1: plain 60 ms, any width 100 ms (this CPU's 1.6x jump); batch 8: width costs grow
    # (every draft accepted: the drafting steps delivered more per ms than plain ones)
    for w in range(9):
        policy.observe(w, np.full(1, w), np.full(1, w), 0.0, 60.0 if w == 0 else 100.0, width=w, batch=1)
        policy.observe(w, np.full(8, w), np.full(8, w), 0.0, 80.0 * (1 + 0.5 * w), width=w, batch=8)
    policy.calibration.value = 1.0
    assert policy.choose_widths(*_chain(1, 8, 0.9), batch=1).max() == 8  # long confident drafts pay
    assert policy.choose_widths(*_chain(1, 8, 0.3), batch=1).max() == 0  # ~0.43 tokens: not for 1.67x
    assert policy.choose_widths(*_chain(8, 8, 0.9), batch=8).max() < 8  # shrinks with batch size
    assert policy.choose_widths(*_chain(8, 8, 0.05), batch=8).max() == 0


def test_nodes_go_to_the_rows_whose_drafts_are_likely_accepted():
    """At batch 8 a verify costs by the drafted tokens in all (padding is skipped): the budget
    goes to the three rows with confident drafts, and the five others verify nothing."""
    from serving.engine.tree import node_totals

    policy = GoodputPolicy(8, remeasure_every=10_000)
    for n in node_totals(64):  # 40 ms plain, +1.2 ms per drafted token
        policy.observe(0, np.zeros(8), np.zeros(8), 0.0, 40.0 + 1.2 * n, width=min(n, 8), batch=8,
                       nodes=n)
    parents, conf, lengths = _chain(8, 8, 0.05)
    conf[:3] = torch.tensor([0.97] * 4 + [0.5] * 4)
    widths = policy.choose_widths(parents, conf, lengths, batch=8)
    assert widths[3:].sum() == 0
    assert (widths[:3] >= 4).all()  # each confident row's 4 likely nodes at ~0.9 tokens each
    assert widths.sum() < 24  # and not the doubtful tail (P = 0.86 x 0.5^j) that costs more


def test_a_width_must_also_pay_for_the_draft_at_its_batch_size():
    """At batch 8 a verify of 8 nodes that costs 5 % more than a plain step pays for 8 x 0.12
    expected tokens (12 %) as long as the draft is free; once drafting at batch 8 is measured at
    2 ms a step (10 % of one), the same drafts are cut to nothing, while batch 1, whose drafts
    were measured cheap, keeps its width."""
    from serving.engine.tree import node_totals

    policy = GoodputPolicy(8, remeasure_every=10_000)
    for n in node_totals(8):
        policy.observe(0, np.zeros(8), np.zeros(8), 0.0, 20.0 + 0.125 * n, width=min(n, 1), batch=8,
                       nodes=n)
        policy.observe(0, np.zeros(1), np.zeros(1), 0.0, 10.0 + 0.1 * n, width=n, batch=1)
    policy.calibration.value = 1.0
    parents, conf, lengths = _chain(8, 1, 0.12)
    assert policy.choose_widths(parents, conf, lengths, batch=8).sum() == 8
    for _ in range(40):
        policy.observe(1, np.ones(8), np.zeros(8), 2.0, 21.0, width=1, batch=8, nodes=8)
        policy.observe(1, np.ones(1), np.ones(1), 0.05, 10.1, width=1, batch=1, nodes=1)
    policy.calibration.value = 1.0
    assert policy.choose_widths(parents, conf, lengths, batch=8).sum() == 0
    assert policy.choose_widths(*_chain(1, 8, 0.9), batch=1).max() == 8


def test_widths_stop_where_drafting_steps_delivered_less_than_plain_ones():
    """The calibration is one for all batch sizes: at batch 1 every draft is accepted, at batch 8
    one row in eight is, and the calibrated model keeps predicting a gain at batch 8. The drafting
    steps there delivered 9 tokens in 28 ms against a plain step's 8 in 20: once eight of them are
    seen, batch 8 verifies nothing (but probes), while batch 1 keeps drafting."""
    from serving.engine.tree import node_totals

    policy = GoodputPolicy(4, remeasure_every=10_000)
    for n in node_totals(8):
        policy.observe(0, np.zeros(1), np.zeros(1), 0.0, 10.0 + 0.1 * n, width=min(n, 4), batch=1, nodes=n)
        policy.observe(0, np.zeros(8), np.zeros(8), 0.0, 20.0 + 1.0 * n, width=min(n, 1), batch=8, nodes=n)
    eights = []
    for _ in range(24):
        w1 = policy.choose_widths(*_chain(1, 4, 0.9), batch=1)
        policy.observe(4, w1, w1, 0.0, 10.0 + 0.1 * int(w1.sum()), width=int(w1.max()), batch=1,
                       nodes=int(w1.sum()))
        w8 = policy.choose_widths(*_chain(8, 1, 0.9), batch=8)
        eights.append(int(w8.sum()))
        accepted = np.array([1] + [0] * 7) * (w8 > 0)
        policy.observe(1, w8, accepted, 0.0, 20.0 + 1.0 * int(w8.sum()), width=int(w8.max()),
                       batch=8, nodes=int(w8.sum()))
    assert eights[:8] == [8] * 8 and eights[-8:] == [0] * 8  # predicted to pay; did not
    assert policy.drafting_loses(8) and not policy.drafting_loses(1)
    assert policy.choose_widths(*_chain(1, 4, 0.9), batch=1).max() == 4


def test_after_drafting_stopped_at_a_batch_size_probes_bring_a_better_drafter_back():
    """Batch 4: drafts that are never accepted stop (the outcome rule, then probes only); once
    they are always accepted, the probes' outcomes turn drafting back on."""
    from serving.engine.policy import BatchState
    from serving.engine.tree import node_totals

    policy = GoodputPolicy(4, probe_every=8, remeasure_every=10_000)
    for n in node_totals(16):
        policy.observe(0, np.zeros(4), np.zeros(4), 0.0, 20.0 + 0.5 * n, width=min(n, 4), batch=4,
                       nodes=n)
    state = BatchState(4, 4, np.full(4, 100))

    def step(accept: bool) -> int:
        k = policy.choose_k(state)
        w = policy.choose_widths(*_chain(4, 4, 0.8), batch=4) if k else np.zeros(4, dtype=np.int64)
        acc = w if accept else np.zeros(4, dtype=np.int64)
        policy.observe(k, np.minimum(w, acc + 1), acc, 0.05, 20.0 + 0.5 * int(w.sum()),
                       width=int(w.max()), batch=4, nodes=int(w.sum()))
        return int(w.sum())

    for _ in range(300):
        step(False)
    assert policy.drafting_loses(4)
    assert sum(step(False) > 0 for _ in range(64)) <= 64 // 8 + 1
    widths = [step(True) for _ in range(400)]
    assert not policy.drafting_loses(4)
    assert sum(w > 0 for w in widths[-50:]) >= 45


def test_plain_steps_the_policy_knows_of_before_the_draft_ask_no_draft():
    """Where a step will be plain whatever the draft holds (drafting at this batch size delivered
    less than plain steps; or the plain step's cost is due to be measured again), choose_k says
    so before the draft (k = 0) instead of the width step throwing a paid-for draft away."""
    from serving.engine.policy import BatchState
    from serving.engine.tree import node_totals

    policy = GoodputPolicy(4, probe_every=10_000, remeasure_every=6)
    for n in node_totals(16):
        policy.observe(0, np.zeros(4), np.zeros(4), 0.0, 20.0 + 0.1 * n, width=min(n, 4), batch=4,
                       nodes=n)
    state = BatchState(4, 4, np.full(4, 100))
    ks = []
    for _ in range(14):  # every draft accepted: drafting pays, but every 6 drafting steps a plain one
        k = policy.choose_k(state)
        ks.append(k)
        w = policy.choose_widths(*_chain(4, 4, 0.9), batch=4) if k else np.zeros(4, dtype=np.int64)
        policy.observe(k, w, w, 0.05, 20.0 + 0.1 * int(w.sum()), width=int(w.max()), batch=4,
                       nodes=int(w.sum()))
    assert ks.count(0) >= 2 and policy.cuts["remeasure"] == ks.count(0)
    runs = "".join("d" if k else "." for k in ks).split(".")
    assert max(len(r) for r in runs) <= 6  # never more than 6 drafting steps without a plain one
    for _ in range(200):  # drafting steps then delivered half a plain step's rate (2 tokens in 20 ms)
        policy.realized.observe(4, 0.5 * 4, 20.0)
    assert policy.drafting_loses(4)
    assert policy.choose_k(state) == 0  # no draft asked for (probes aside)


def test_width_calibration_learns_from_outcomes(monkeypatch):
    from serving.engine import realized_rates

    monkeypatch.setattr(realized_rates, "MIN_STEPS", 10**9)  # the calibration alone
    policy = GoodputPolicy(4, remeasure_every=10_000)
    for w in range(5):
        policy.observe(w, np.zeros(1), np.zeros(1), 0.0, 60.0 if w == 0 else 80.0, width=w, batch=1)
    for _ in range(200):  # the drafter claims 0.9 but nothing is ever accepted
        w = policy.choose_widths(*_chain(1, 4, 0.9), batch=1).max()
        ms = 60.0 if w == 0 else 80.0
        policy.observe(4, np.array([min(w, 1)]), np.zeros(1), 0.0, ms, width=w, batch=1)
    assert policy.calibration.value < 0.2
    assert policy.choose_widths(*_chain(1, 4, 0.9), batch=1).max() == 0


def test_tree_steps_are_traced_and_train(ids_target, refs, run):
    """Trace records of tree steps: the chain view (accepted path + first rejected node) with the
    target top-k at those nodes, the whole tree in tree_ids/parents; codec round trip; the
    trainer's examples build from them."""
    from trace_samples import assert_same_trace

    from feedback.bus.codec import decode, encode
    from feedback.bus.sink import InProcessTraceSink
    from serving.observers import TraceRecorder
    from trainer.examples import build_examples

    sink = InProcessTraceSink()
    recorder = TraceRecorder(sink, ids_target.fingerprint)
    drafter = TreeReplayDrafter(refs, seed=2, corrupt_every=4)
    engine = TorchEngine(ids_target, drafter, EngineConfig(k=6, trace_topk=5), [recorder])
    reqs = [_req("a", PROMPTS[0], SamplingParams(max_tokens=30)),
            _req("b", PROMPTS[2], SamplingParams(max_tokens=30))]
    outs = run(engine, reqs)
    records = {r.request_id: r for r in sink.drain()}
    model = ids_target.model
    for req, chunks in zip(reqs, outs):
        rec = records[req.request_id]
        st = rec.steps
        out = _tokens(chunks)
        assert st.tree_ids is not None and (st.tree_ids[:, 0] >= 0).any()
        for s in range(st.num_steps):
            pos, nd, na = int(st.positions[s]), int(st.num_drafted[s]), int(st.num_accepted[s])
            drafts = st.draft_ids[s, :nd].tolist()
            assert drafts[:na] == out[pos : pos + na]
            assert set(drafts) <= set(st.tree_ids[s].tolist())
            # top-1 at each chain-view row = the target's argmax after prompt+output[:pos]+drafts[:j]
            for j in range(nd + 1):
                ctx = list(req.prompt_ids) + out[:pos] + drafts[:j]
                with torch.inference_mode():
                    best = int(model(torch.tensor([ctx], device=model.device)).logits[0, -1].argmax())
                assert int(st.target_topk_ids[s, j, 0]) == best
        assert_same_trace(decode(encode(rec)), rec)
        assert build_examples(rec)


def test_tree_steps_count_drafts_two_ways_and_say_which(ids_target, refs, run):
    """A request's usage counts every tree node the target verified, as Prometheus'
    draft_nodes does; Prometheus' drafted tokens count each step's path view, as the traces do."""
    from prometheus_client import CollectorRegistry

    from serving.metrics import SpecMetrics

    registry, rec = CollectorRegistry(), Recorder()
    drafter = TreeReplayDrafter(refs, seed=2, corrupt_every=4)
    engine = TorchEngine(ids_target, drafter, EngineConfig(k=6), [rec, SpecMetrics(registry)])
    reqs = [_req("a", PROMPTS[0], SamplingParams(max_tokens=30)),
            _req("b", PROMPTS[2], SamplingParams(max_tokens=30))]
    outs = run(engine, reqs)
    usage = sum(chunks[-1].stats.drafted_tokens for chunks in outs)
    nodes = registry.get_sample_value("specloop_spec_draft_nodes_total")
    path = registry.get_sample_value("specloop_spec_drafted_tokens_total")
    assert nodes == usage == sum(int(s.num_drafted.sum() if s.tree_nodes is None else s.tree_nodes.sum())
                                 for s in rec.steps)
    assert path == sum(int(s.num_drafted.sum()) for s in rec.steps) < nodes  # branches cost nodes


def test_cheap_drafter_that_never_pays_is_only_probed():
    from serving.engine.policy import BatchState

    policy = GoodputPolicy(8, probe_every=16, remeasure_every=10_000)
    policy.observe(0, np.zeros(1), np.zeros(1), 0.0, 60.0, width=0, batch=1)
    for w in range(1, 9):
        policy.observe(w, np.ones(1), np.zeros(1), 0.05, 100.0, width=w, batch=1)
    state = BatchState(1, 8, np.array([100]))
    asked = 0
    for _ in range(320):
        probes = policy.probes
        k = policy.choose_k(state)
        if k:
            asked += 1
            w = policy.choose_widths(*_chain(1, 8, 0.2), batch=1).max()
            assert (w > 0) == (policy.probes > probes)  # never pays; probes still verify some
    assert asked <= 16 + 320 // 16 + 1  # full budget until the streak, then probes only
    while policy.choose_k(state) == 0:  # the next probe finds drafts that pay: back on
        pass
    assert policy.choose_widths(*_chain(1, 8, 0.97), batch=1).max() > 0
    assert policy.choose_k(state) == 8


def test_suffix_tree_branches_over_both_sources():
    """Prompt lookup says 1 2 -> 3, the tenant index says 1 2 -> 4: the tree offers both."""
    d = SuffixDrafter(SuffixConfig(min_confidence=0.0, tree_branches=4))
    for _ in range(3):
        d.observe("default", [1, 2, 4, 5, 6])
    ctx = [9, 1, 2, 3, 8, 1, 2]
    view = DraftRequestView("r", ctx, len(ctx))
    d.add_request(view)
    prop = d.propose([view], 6)
    n = int(prop.lengths[0])
    roots = {t for t, p in zip(prop.tokens[0, :n].tolist(), prop.parents[0, :n].tolist()) if p == -1}
    assert {3, 4} <= roots
    assert len(roots) == sum(p == -1 for p in prop.parents[0, :n].tolist())  # no duplicate roots


def test_probes_verify_drafts_so_a_drafter_that_improves_comes_back():
    from serving.engine.policy import BatchState

    policy = GoodputPolicy(4, probe_every=8, remeasure_every=10_000)
    policy.observe(0, np.zeros(1), np.zeros(1), 0.0, 60.0, width=0, batch=1)
    for w in range(1, 5):
        policy.observe(w, np.ones(1), np.zeros(1), 0.01, 90.0, width=w, batch=1)
    state = BatchState(1, 4, np.array([100]))

    def step(accepted_when_drafted: int) -> int:
        k = policy.choose_k(state)
        w = policy.choose_widths(*_chain(1, 4, 0.8), batch=1).max() if k else 0
        acc = min(w, accepted_when_drafted)
        policy.observe(k, np.array([min(w, acc + 1)]), np.array([acc]), 0.01,
                       60.0 if w == 0 else 90.0, width=w, batch=1)
        return w

    for _ in range(200):  # the drafter is useless: speculation goes off
        step(0)
    assert sum(step(0) > 0 for _ in range(64)) <= 64 // 8 + 1
    # the drafter becomes good (e.g. its index learned the domain): probes notice, it comes back
    widths = [step(4) for _ in range(300)]
    assert sum(w > 0 for w in widths[-50:]) >= 45


class ChainReplayDrafter(_Stateless):
    """A 'learned' drafter (standalone kind) proposing each request's reference continuation as a
    confident chain: wherever the hybrid takes it, it is right."""

    kind = "standalone"
    version = "chain"
    feature_layers = ()

    def __init__(self, references):
        self.refs = references


    def propose(self, views, k):
        n = len(views)
        tok = torch.zeros(n, k, dtype=torch.long)
        lengths = torch.zeros(n, dtype=torch.long)
        for i, v in enumerate(views):
            ref = self.refs.get(tuple(v.token_ids[: v.prompt_len]), [])
            nxt = ref[len(v.token_ids) - v.prompt_len:][:k]
            tok[i, : len(nxt)] = torch.tensor(nxt, dtype=torch.long)
            lengths[i] = len(nxt)
        return DraftProposal(tokens=tok, lengths=lengths, probs=torch.ones(n, k),
                             source=np.full(n, DrafterKind.STANDALONE, dtype=np.uint8),
                             confidence=torch.full((n, k), 0.99))


def test_hybrid_keeps_suffix_trees_beside_learned_chains(ids_target, refs, run):
    """The hybrid verifies the suffix drafter's trees and the learned drafter's chains in the same
    batch (rows of each kind, chosen per row), and greedy output stays token-identical."""
    from serving.drafters.hybrid import HybridDrafter, HybridPolicy

    suffix = TreeReplayDrafter(refs, seed=1, corrupt_every=3)
    policy = HybridPolicy(suffix_threshold=100.0, explore=0.5, prior_acceptance=0.0, seed=3)
    # the learned drafter knows every other prompt's continuation and proposes nothing for the
    # rest, whose rows keep the suffix trees: a batch of both kinds mixes them whatever the timing
    # (knowing all of them, it took nearly every row once its estimate rose, and the few mixed
    # steps left depended on how a busy machine batched the staggered arrivals)
    learned = ChainReplayDrafter({p: r for i, (p, r) in enumerate(refs.items()) if i % 2 == 0})
    hybrid = HybridDrafter(suffix, learned, policy)
    rec, _ = _serve_greedy(ids_target, hybrid, refs, run)
    mixed = [s for s in rec.steps if s.tree_nodes is not None
             and {DrafterKind.SUFFIX, DrafterKind.STANDALONE} <= {int(x) for x in s.source}]
    assert mixed  # trees and learned chains verified together


def test_the_policy_hears_that_a_hybrid_mixes_sources(ids_target, refs, run):
    """The policy floors a costly drafter's best node at its acceptance estimate unless the
    estimate mixes sources (GoodputPolicy.choose_k): the engine says so from the drafter."""
    from serving.drafters.hybrid import HybridDrafter

    class Spy(GoodputPolicy):
        def choose_k(self, state):
            seen.add(state.mixed_sources)
            return super().choose_k(state)

    for drafter, mixed in ((ChainReplayDrafter(refs), False),
                           (HybridDrafter(TreeReplayDrafter(refs, seed=1), ChainReplayDrafter(refs)), True)):
        seen: set[bool] = set()
        engine = TorchEngine(ids_target, drafter, EngineConfig(k=4), policy=Spy(4))
        [chunks] = run(engine, [_req("p", PROMPTS[0], SamplingParams(max_tokens=8))])
        assert _tokens(chunks) == refs[tuple(PROMPTS[0])][:8] and seen == {mixed}


def test_hybrid_cuts_trees_to_chains_beside_a_sampled_learned_draft():
    """A sampled learned draft carries its distributions, which only chains are verified with: the
    suffix rows of that step keep their best path."""
    from serving.drafters.hybrid import _as_chains

    tok = torch.tensor([[5, 9, 6, 7, 8]])
    prop = DraftProposal(tokens=tok.clone(), lengths=torch.tensor([5]), probs=torch.ones(1, 5),
                         source=np.full(1, DrafterKind.SUFFIX, dtype=np.uint8),
                         confidence=torch.tensor([[0.9, 0.1, 0.8, 0.7, 0.2]]),
                         parents=torch.tensor([[-1, -1, 0, 2, 0]]))
    out = _as_chains(prop)
    assert out.parents is None and int(out.lengths[0]) == 3
    assert out.tokens[0, :3].tolist() == [5, 6, 7]
    assert out.confidence[0, :3].tolist() == pytest.approx([0.9, 0.8, 0.7])


def test_expected_accepted_of_a_tree_sums_its_path_probabilities():
    from serving.drafters.hybrid import expected_accepted

    conf = torch.tensor([[0.5, 0.5, 0.8, 0.0], [0.5, 0.5, 0.8, 0.0]])
    lengths = torch.tensor([3, 3])
    chain = expected_accepted(conf[:1], lengths[:1])  # 0.5 + 0.25 + 0.2
    tree = expected_accepted(conf[1:], lengths[1:], torch.tensor([[-1, -1, 0, 0]]))  # 0.5 + 0.5 + 0.4
    assert float(chain) == pytest.approx(0.95) and float(tree) == pytest.approx(1.4)


def test_path_confidence_multiplies_clipped_confidences_along_each_path():
    from serving.engine.tree import path_confidence

    # node space: the root; 1 <- root; 2 <- 1; 3 <- root; 4 <- 2; 5 padding (parent -1)
    parents = np.array([[-1, 0, 1, 0, 2, -1], [-1, 0, 1, 2, 3, 4]])
    conf = np.array([[0.5, 0.8, 1.5, -0.2, 0.9], [0.9, 0.9, 0.5, 1.0, 0.5]], dtype=np.float32)
    got = path_confidence(parents, conf)
    c = conf.astype(np.float64)
    assert got[0].tolist() == pytest.approx([0.5, 0.5 * c[0, 1], 1.0, 0.0, 0.0])  # clipped to [0, 1]
    assert got[1].tolist() == pytest.approx(np.cumprod(c[1]).tolist())  # a chain: running products


def test_hybrid_leaves_the_suffix_drafters_trees_on():
    from serving.drafters.hybrid import HybridDrafter

    suffix = SuffixDrafter(SuffixConfig(tree_branches=4, min_confidence=0.0))
    HybridDrafter(suffix, ChainReplayDrafter({}))
    assert suffix.trees
    ctx = [1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 4, 7, 1, 2]
    hybrid = HybridDrafter(suffix, ChainReplayDrafter({}))
    view = DraftRequestView("r", ctx, len(ctx))
    hybrid.add_request(view)
    prop = hybrid.propose([view], 6)
    assert prop.parents is not None and (prop.parents[0, : int(prop.lengths[0])] == -1).sum() >= 2


def test_a_drafter_whose_drafts_the_batch_cannot_afford_is_only_probed():
    """Acceptance says drafting pays (best_k > 0 at batch-agnostic costs), but at batch 8 every
    width costs far more than it brings, so choose_width cuts each draft to nothing: the costly
    drafter waits 1, 3, 7, ... steps after each cut, and after ``probe_every`` cuts in a row
    drafts only on probes."""
    from feedback.goodput import CostModel
    from serving.engine.policy import BatchState

    policy = GoodputPolicy(4, probe_every=8, remeasure_every=10_000)
    for w in range(5):
        policy.observe(w, np.zeros(8), np.zeros(8), 0.0, 30.0 * (1 + 0.8 * w), width=w, batch=8)
    # the batch-agnostic cost model (what best_k reads) says drafts are not cheap but pay
    policy.costs = CostModel(target_step_ms=30.0, draft_ms_per_token=1.0, verify_slope=0.02)
    policy.acceptance.observe(np.full(8, 4), np.full(8, 3))  # drafts used to be accepted
    policy.calibration.value = 1.0
    state = BatchState(8, 4, np.full(8, 100))
    assert policy.choose_k(state) > 0
    policy.probe.off_streak = 0
    drafted = []
    for _ in range(200):
        k = policy.choose_k(state)
        drafted.append(k > 0)
        if k:
            policy.choose_widths(*_chain(8, k, 0.3), batch=8).max()
    at = [i for i, d in enumerate(drafted) if d]
    assert at[:4] == [0, 2, 6, 14]  # each cut doubles the wait before the next draft
    assert policy.cuts["backoff"] >= 1 + 3 + 7
    assert len(at) <= 8 + 200 // policy.probe_interval() + 1  # then probes only
    assert len(at) >= 5
