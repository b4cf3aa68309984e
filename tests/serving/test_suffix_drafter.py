import random

import numpy as np
import pytest
import torch

from feedback.bus.trace import DrafterKind
from serving.drafters.base import Drafter, DraftRequestView
from serving.drafters.suffix import SuffixConfig, SuffixDrafter


def view(tokens, prompt_len=None, rid="r", tenant="default"):
    return DraftRequestView(rid, list(tokens), len(tokens) if prompt_len is None else prompt_len, tenant)


def drafter(**cfg) -> SuffixDrafter:
    cfg.setdefault("min_confidence", 0.0)
    cfg.setdefault("tree_branches", 1)  # chains here; trees: test_tree_engine.py
    return SuffixDrafter(SuffixConfig(**cfg))


def fresh_tokens(n, rng, lo=1000, hi=40000):
    """Distinct random ids: no accidental repeats for prompt lookup to find."""
    return rng.sample(range(lo, hi), n)


def propose_one(d, v, k=4):
    prop = d.propose([v], k)
    n = int(prop.lengths[0])
    return prop.tokens[0, :n].tolist(), prop


def decode(d, prompt, output, k=4, rid="r", tenant="default"):
    """Replay greedy speculative decoding of a known output; returns tokens per verify step."""
    v = view(prompt + output[:1], len(prompt), rid, tenant)
    d.add_request(v)
    pos, steps = 1, 0
    while pos < len(output):
        draft, _ = propose_one(d, v, k)
        acc = 0
        while acc < len(draft) and pos + acc < len(output) and draft[acc] == output[pos + acc]:
            acc += 1
        commit = output[pos : pos + acc + 1]
        v.token_ids = v.token_ids + commit
        d.on_verified(rid, commit, None)
        pos += len(commit)
        steps += 1
    d.remove_request(rid, output)
    return (len(output) - 1) / steps


# -- prompt lookup ---------------------------------------------------------------------------


def test_repeats_in_the_prompt_are_proposed():
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 40, 41, 42, 7, 8, 9]
    draft, prop = propose_one(drafter(), view(prompt), k=4)
    assert draft == [10, 11, 12, 40]
    assert prop.source[0] == DrafterKind.SUFFIX
    assert torch.all(prop.probs == 1.0)


def test_context_counts_leave_out_the_present_occurrence():
    # "7 8" occurred once before (followed by 9) and once now, at the end, followed by nothing yet
    d = drafter()
    d.propose([view([5, 6, 7, 8, 9, 10, 7, 8])], 2)
    steps = d.last_drafts[0].steps
    assert [(s.token, s.count, s.total) for s in steps] == [(9, 1, 1), (10, 1, 1)]


def test_no_repeat_no_index_proposes_nothing():
    draft, prop = propose_one(drafter(), view(fresh_tokens(30, random.Random(1))))
    assert draft == [] and prop.source[0] == DrafterKind.NONE


def test_prompt_lookup_can_be_turned_off():
    prompt = [5, 6, 7, 8, 9, 10, 7, 8]
    assert propose_one(drafter(), view(prompt))[0] == [9, 10, 7, 8]
    assert propose_one(drafter(use_prompt_lookup=False), view(prompt))[0] == []


def test_output_loops_are_followed_as_the_request_grows():
    d = drafter()
    loop = [100, 101, 102, 103, 104]
    v = view([1, 2, 3] + loop, prompt_len=3)
    d.add_request(v)
    for _ in range(3):
        d.on_verified("r", loop, None)
        v.token_ids = v.token_ids + loop
    assert propose_one(d, v, k=8)[0] == loop + loop[:3]


# -- the tenant index -----------------------------------------------------------------------


def test_index_learns_a_finished_output_so_the_same_request_drafts_long():
    rng = random.Random(2)
    prompt, output = fresh_tokens(20, rng), fresh_tokens(60, rng, lo=50000, hi=90000)
    d = drafter()
    first = decode(d, prompt, output, rid="a")
    second = decode(d, prompt, output, rid="b")
    assert first == pytest.approx(1.0)  # nothing to go on
    assert second >= 4.5  # k=4: nearly every step accepts all four drafts


def test_aborted_requests_do_not_feed_the_index():
    rng = random.Random(3)
    prompt, output = fresh_tokens(10, rng), fresh_tokens(30, rng, lo=50000, hi=90000)
    d = drafter()
    d.add_request(view(prompt + output, len(prompt), "a"))
    d.remove_request("a", None)
    assert "default" not in d.proposer.indexes or d.index("default").num_tokens == 0
    assert propose_one(d, view(prompt + output[:5], len(prompt), "b"))[0] == []


def test_observe_feeds_outputs_served_elsewhere():
    d = drafter()
    d.observe("t", [300, 301, 302, 303, 304, 305, 306])
    draft, _ = propose_one(d, view([1, 2, 300, 301, 302], tenant="t"))
    assert draft == [303, 304, 305, 306]
    assert d.last_drafts[0].source == "index"


def test_observed_output_reaches_a_request_already_running():
    d = drafter()
    v = view([1, 2, 300, 301], tenant="t")
    assert propose_one(d, v)[0] == []
    d.observe("t", [300, 301, 302, 303, 304, 305])
    d.on_verified("r", [302], None)
    v.token_ids = v.token_ids + [302]
    assert propose_one(d, v)[0] == [303, 304, 305]


def test_tenants_are_isolated():
    d = drafter()
    d.observe("a", [300, 301, 302, 303, 304, 305])
    assert propose_one(d, view([1, 300, 301], tenant="a", rid="x"))[0] == [302, 303, 304, 305]
    assert propose_one(d, view([1, 300, 301], tenant="b", rid="y"))[0] == []


def test_the_most_frequent_continuation_wins_with_a_lower_confidence():
    d = drafter(index_prompt_tail=0)
    for seq in ([7, 8, 9, 1, 2], [7, 8, 9, 1, 2], [7, 8, 9, 5, 6]):
        d.observe("t", seq)
    draft, prop = propose_one(d, view([40, 7, 8, 9], tenant="t"), k=2)
    assert draft == [1, 2]
    conf = prop.confidence[0].tolist()
    assert 0.3 < conf[0] < 2 / 3 + 1e-6  # 2 of 3 occurrences, shrunk by the prior
    strict = drafter(index_prompt_tail=0, min_confidence=0.9)
    for seq in ([7, 8, 9, 1, 2], [7, 8, 9, 1, 2], [7, 8, 9, 5, 6]):
        strict.observe("t", seq)
    assert propose_one(strict, view([40, 7, 8, 9], tenant="t"), k=2)[0] == []


def test_eviction_keeps_the_index_within_its_budget_and_forgets_the_oldest():
    rng = random.Random(4)
    d = drafter(max_index_tokens=200, index_generations=4, index_prompt_tail=0)
    seqs = [fresh_tokens(20, rng) for _ in range(40)]
    for s in seqs:
        d.observe("t", s)
    idx = d.index("t")
    assert 150 <= idx.num_tokens <= 200
    assert idx.num_states <= 2 * idx.num_tokens + len(idx.gens)
    assert propose_one(d, view([1] + seqs[0][:3], tenant="t", rid="old"))[0] == []
    assert propose_one(d, view([1] + seqs[-1][:3], tenant="t", rid="new"))[0] == seqs[-1][3:7]


def test_index_tenants_are_bounded_lru():
    d = drafter(max_tenants=2)
    for t in ("a", "b", "a", "c"):
        d.observe(t, [1, 2, 3])
    assert set(d.proposer.indexes) == {"a", "c"}


# -- the batch contract -----------------------------------------------------------------------


def test_mixed_batch_shapes_sources_and_confidences():
    rng = random.Random(5)
    d = SuffixDrafter()  # default config
    d.observe("t", [300, 301, 302, 303, 304, 305, 306, 307])
    rows = [
        view([5, 6, 7, 8, 9, 10, 11, 12, 7, 8], rid="repeat"),
        view(fresh_tokens(12, rng), rid="nothing"),
        view([1, 300, 301, 302], rid="index", tenant="t"),
        view([9], rid="tiny"),
    ]
    for k in (1, 3, 8):
        prop = d.propose(rows, k)
        assert prop.tokens.shape == (4, k) and prop.tokens.dtype == torch.long
        assert prop.probs.shape == (4, k) and torch.all(prop.probs == 1.0)
        assert prop.confidence.shape == (4, k)
        assert prop.source.dtype == np.uint8 and prop.source.shape == (4,)
        for i in range(4):
            n = int(prop.lengths[i])
            assert 0 <= n <= k
            assert prop.source[i] == (DrafterKind.SUFFIX if n else DrafterKind.NONE)
            conf = prop.confidence[i]
            assert torch.all((conf[:n] > 0) & (conf[:n] <= 1)) and torch.all(conf[n:] == 0)
            assert torch.all(prop.tokens[i, n:] == 0)
        assert [int(x) > 0 for x in prop.lengths] == [True, False, True, False]
    assert d.propose(rows, 0).tokens.shape == (4, 0)


def test_implements_the_drafter_protocol():
    d = SuffixDrafter()
    assert isinstance(d, Drafter)
    assert (d.kind, d.version, d.feature_layers) == ("suffix", "day0", ())


def test_incremental_state_agrees_with_a_rebuild():
    """Whether a request's state was grown step by step (on_verified), caught up from the view,
    or rebuilt from scratch, it drafts the same tokens."""
    rng = random.Random(6)
    vocab = list(range(20))
    d_inc, d_view = drafter(), drafter()
    history = [[rng.choice(vocab) for _ in range(rng.randrange(5, 40))] for _ in range(6)]
    for h in history:
        for d in (d_inc, d_view):
            d.observe("t", h)
    prompt = [rng.choice(vocab) for _ in range(15)]
    v_inc, v_view = view(prompt, tenant="t", rid="a"), view(prompt, tenant="t", rid="a")
    d_inc.add_request(v_inc)
    d_view.add_request(v_view)
    observed = list(history)
    for step in range(40):
        new = [rng.choice(vocab) for _ in range(rng.randrange(1, 4))]
        v_inc.token_ids = v_inc.token_ids + new
        v_view.token_ids = v_view.token_ids + new
        d_inc.on_verified("a", new, None)  # d_view only ever sees the growing view
        if step % 7 == 3:  # traffic finishing meanwhile changes the index under the request
            observed.append([rng.choice(vocab) for _ in range(20)])
            for d in (d_inc, d_view):
                d.observe("t", observed[-1])
        d_new = drafter()
        for h in observed:
            d_new.observe("t", h)
        a = propose_one(d_inc, v_inc, k=5)[0]
        assert a == propose_one(d_view, v_view, k=5)[0]
        assert a == propose_one(d_new, view(v_inc.token_ids, tenant="t", rid="a"), k=5)[0]


def test_a_row_that_sat_out_catches_up_at_its_next_draft_and_says_so():
    """on_verified only counts steps (a drafter kept off pays ~nothing per step): a row's state
    catches up from its view at the next draft, which drafts what a rebuilt drafter drafts, and
    the time committing more than the last step's tokens is the proposal's catch_up_ms."""
    rng = random.Random(3)
    loop = fresh_tokens(12, rng)
    d = drafter()
    v = view(loop + loop[:3], tenant="t", rid="a")
    d.add_request(v)
    for step in range(30):  # the policy keeps the drafter off for 30 steps
        v.token_ids = v.token_ids + [loop[(3 + step) % 12]]
        d.on_verified("a", v.token_ids[-1:], None)
    tokens, prop = propose_one(d, v, k=5)
    assert prop.catch_up_ms > 0.0
    assert tokens == propose_one(drafter(), view(v.token_ids, tenant="t", rid="a"), k=5)[0]
    assert tokens == [loop[(33 + j) % 12] for j in range(5)]
    v.token_ids = v.token_ids + tokens[:2]  # drafting every step: no backlog
    d.on_verified("a", tokens[:2], None)
    assert propose_one(d, v, k=5)[1].catch_up_ms == 0.0


def _trace(request_id, tenant, prompt, output):
    from feedback.bus.trace import StepArrays, TraceRecord
    from feedback.target.fingerprint import TargetFingerprint

    s = len(output)  # one verify step per token, nothing drafted
    steps = StepArrays(
        positions=np.arange(s, dtype=np.int32), num_drafted=np.zeros(s, np.int16),
        num_accepted=np.zeros(s, np.int16), source=np.zeros(s, np.uint8),
        draft_ids=np.zeros((s, 0), np.int32), draft_probs=np.zeros((s, 0), np.float32),
        target_topk_ids=np.zeros((s, 1, 1), np.int32), target_topk_logprobs=np.zeros((s, 1, 1), np.float16),
    )
    return TraceRecord(
        request_id=request_id, tenant=tenant, drafter_kind="suffix", drafter_version="day0",
        target=TargetFingerprint(model_id="m", tokenizer_hash="h", vocab_size=100),
        prompt_ids=np.array(prompt, np.int32), output_ids=np.array(output, np.int32), steps=steps,
    )


def test_traces_from_other_replicas_are_indexed_once():
    d = drafter()
    d.observe_trace(_trace("elsewhere", "t", [1, 2], [300, 301, 302, 303, 304]))
    assert propose_one(d, view([9, 300, 301], tenant="t", rid="x"))[0] == [302, 303, 304]
    # a request served here is indexed when it finishes; its own trace coming back is skipped
    out = [400, 401, 402, 403, 404, 405]
    d.add_request(view([7] + out, prompt_len=1, rid="mine", tenant="t"))
    d.remove_request("mine", out)
    d.observe_trace(_trace("mine", "t", [7], out))
    d.observe_trace(_trace("mine-again", "t", [7], out))
    d.propose([view([9, 400, 401], tenant="t", rid="y")], 4)
    assert d.last_drafts[0].steps[0].total == 2  # this replica's copy + the other replica's


def test_draft_length_grows_with_match_length_and_evidence():
    d = SuffixDrafter()  # default confidences and cut-off
    seq = list(range(300, 340))
    d.observe("t", seq)
    short = propose_one(d, view([9, 310], tenant="t", rid="a"), k=8)[0]
    long = propose_one(d, view([9] + seq[:12], tenant="t", rid="b"), k=8)[0]
    assert long == seq[12:20]
    assert len(short) < len(long)
    for _ in range(5):
        d.observe("t", seq)
    assert len(propose_one(d, view([9, 310], tenant="t", rid="c"), k=8)[0]) > len(short)
    conf = d.propose([view([9] + seq[:12], tenant="t", rid="b")], 8).confidence[0]
    assert torch.all(conf[1:] >= conf[:-1])  # each accepted token lengthens the match


def test_observe_from_another_thread_while_proposing():
    import threading

    rng = random.Random(7)
    d = SuffixDrafter()
    stop = threading.Event()
    errors = []

    def feed():
        try:
            while not stop.is_set():
                d.observe("t", [rng.randrange(50) for _ in range(30)])
        except Exception as e:  # noqa: BLE001 - a thread's error must reach the test
            errors.append(e)

    th = threading.Thread(target=feed)
    th.start()
    v = view([rng.randrange(50) for _ in range(20)], tenant="t")
    try:
        for _ in range(300):
            prop = d.propose([v], 4)
            commit = prop.tokens[0, : int(prop.lengths[0])].tolist()[:1] + [rng.randrange(50)]
            d.on_verified("r", commit, None)
            v.token_ids = v.token_ids + commit
    finally:
        stop.set()
        th.join()
    assert not errors and d.index("t").num_tokens > 0
