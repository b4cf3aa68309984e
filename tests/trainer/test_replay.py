import numpy as np
from trainer_tracegen import make_trace

from feedback.target.fingerprint import TargetFingerprint
from trainer.replay import ReplayBuffer, is_heldout


def test_heldout_split_is_by_request_and_stable():
    rb = ReplayBuffer(heldout_fraction=0.3, heldout_size=1000, min_heldout=0)  # the pure hash split
    recs = [make_trace("a", seed=i) for i in range(60)]
    rb.extend(recs)
    held = {r.request_id for r in rb.heldout}
    train = {r.request_id for r in rb.train_records}
    assert held and train and not (held & train)
    assert held == {r.request_id for r in recs if is_heldout(r.request_id, 0.3)}


def test_heldout_keeps_only_the_most_recent():
    rb = ReplayBuffer(heldout_fraction=0.5, heldout_size=3, min_heldout=0)
    recs = [make_trace("a", seed=i) for i in range(40)]
    rb.extend(recs)
    expected = [r.request_id for r in recs if is_heldout(r.request_id, 0.5)][-3:]
    assert [r.request_id for r in rb.heldout] == expected


def test_recent_traces_are_sampled_more():
    rb = ReplayBuffer(heldout_fraction=0.0, half_life=10)
    recs = [make_trace("a", seed=i) for i in range(60)]
    rb.extend(recs)
    w = rb.weights()
    assert w[-1] == 1.0 and np.all(np.diff(w) > 0)
    counts = {}
    for r in rb.sample(3000, np.random.default_rng(0)):
        counts[r.request_id] = counts.get(r.request_id, 0) + 1
    old = sum(counts.get(r.request_id, 0) for r in recs[:10])
    new = sum(counts.get(r.request_id, 0) for r in recs[-10:])
    assert new > 10 * max(old, 1)


def test_duplicates_and_foreign_targets_are_refused():
    rb = ReplayBuffer(heldout_fraction=0.0, fingerprint=make_trace("a", seed=0).target)
    r = make_trace("a", seed=0)
    assert rb.add(r) and not rb.add(r)
    same_content = make_trace("a", seed=0, request_id="other-id")
    assert not rb.add(same_content)
    other = make_trace("a", seed=1).model_copy(
        update={"target": TargetFingerprint(model_id="x", tokenizer_hash="f" * 16, vocab_size=48)})
    assert not rb.add(other)
    assert rb.rejected == {"duplicate": 2, "fingerprint": 1}
    assert len(rb) == 1 and rb.tokens_seen == len(r.output_ids)


def test_dedup_memory_is_bounded_and_forgets_the_oldest():
    rb = ReplayBuffer(capacity=5, heldout_fraction=0.0, max_seen=10)
    recs = [make_trace("a", seed=i, out_len=4) for i in range(30)]
    rb.extend(recs)
    assert len(rb._seen_ids) == 10 and len(rb._seen_keys) == 10 and len(rb) == 5
    assert not rb.add(recs[-1])  # recent: still a duplicate
    assert rb.add(recs[0])  # long forgotten: accepted again


def test_small_stream_still_gets_its_heldout_share():
    from trainer_tracegen import make_trace

    from trainer.replay import ReplayBuffer, is_heldout

    # request ids the hash split would all put in training
    recs = [r for r in (make_trace("a", seed=i, request_id=f"q-{i}") for i in range(200))
            if not is_heldout(r.request_id, 0.15)][:20]
    rb = ReplayBuffer(heldout_fraction=0.15, min_heldout=2)
    rb.extend(recs)
    assert len(rb.heldout) == 2 and len(rb) == 18
    assert {r.request_id for r in rb.heldout}.isdisjoint(r.request_id for r in rb.train_records)


def test_traces_of_another_target_are_refused_with_a_warning_once(caplog):
    ours = make_trace("a", seed=0).target
    rb = ReplayBuffer(heldout_fraction=0.0, fingerprint=ours)
    theirs = TargetFingerprint(model_id="x", tokenizer_hash="f" * 16, vocab_size=48)
    foreign = [make_trace("a", seed=i).model_copy(update={"target": theirs}) for i in range(3)]
    with caplog.at_level("WARNING", logger="trainer.replay"):
        assert rb.extend(foreign) == 0
    assert rb.rejected["fingerprint"] == 3
    (warning,) = [r for r in caplog.records if r.name == "trainer.replay"]
    assert str(theirs) in warning.getMessage() and str(ours) in warning.getMessage()
