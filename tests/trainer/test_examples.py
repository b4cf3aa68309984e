import numpy as np
from trainer_tracegen import make_trace

from trainer.examples import build_examples, count_rows, truncate_left


def test_main_sequence_has_one_row_per_output_token_with_its_context():
    rec = make_trace("a", seed=1, out_len=20)
    main = build_examples(rec)[0]
    assert not main.discard
    P, out = len(rec.prompt_ids), rec.output_ids
    assert main.num_rows == len(out)
    assert np.array_equal(main.ctx_len, P + np.arange(len(out)))
    # greedy target: the top-1 at each accepted row is the emitted token
    assert np.array_equal(main.topk_ids[:, 0], out)


def test_discard_branches_carry_the_drafted_prefix_and_the_rejected_token():
    rec = make_trace("a", seed=2, out_len=30, k=3)
    st, P = rec.steps, len(rec.prompt_ids)
    exs = build_examples(rec, discard_weight=0.25)
    branches = [e for e in exs if e.discard]
    rejecting = [s for s in range(st.num_steps) if st.num_accepted[s] < st.num_drafted[s]]
    assert len(branches) == len(rejecting) > 0
    for ex, s in zip(branches, rejecting):
        pos, na, nd = int(st.positions[s]), int(st.num_accepted[s]), int(st.num_drafted[s])
        assert np.array_equal(ex.tokens[P + pos:], st.draft_ids[s, :nd])
        assert np.array_equal(ex.tokens[:P + pos], np.concatenate([rec.prompt_ids, rec.output_ids[:pos]]))
        assert np.array_equal(ex.ctx_len, P + pos + np.arange(na + 1, nd + 1))
        assert np.array_equal(ex.topk_ids, st.target_topk_ids[s, na + 1:nd + 1])
        assert np.allclose(ex.weights, 0.25)
    main = exs[0]
    rej_rows = np.flatnonzero(main.rejected_ids >= 0)
    assert len(rej_rows) == len(rejecting)
    for r, s in zip(rej_rows, rejecting):
        na = int(st.num_accepted[s])
        assert main.ctx_len[r] == P + int(st.positions[s]) + na
        assert main.rejected_ids[r] == st.draft_ids[s, na]
        assert main.rejected_ids[r] != main.topk_ids[r, 0]  # greedy: rejected != target's choice


def test_rows_add_up_to_all_verified_positions():
    rec = make_trace("b", seed=3, k=4)
    st = rec.steps
    main, disc = count_rows(build_examples(rec))
    assert main + disc == int((st.num_drafted.astype(int) + 1).sum())
    assert count_rows(build_examples(rec, include_discard=False)) == (len(rec.output_ids), 0)


def test_left_truncation_keeps_context_alignment():
    rec = make_trace("a", seed=4, out_len=20)
    main = build_examples(rec)[0]
    cut = truncate_left(main, 10)
    assert len(cut.tokens) == 10
    shift = len(main.tokens) - 10
    for c, t in zip(cut.ctx_len, cut.topk_ids[:, 0]):
        # the row's predicted token is still the token right after its context
        assert cut.tokens[c] == t if c < len(cut.tokens) else True
        assert np.array_equal(cut.tokens[:c], main.tokens[shift:shift + c])
    assert cut.ctx_len.min() >= 1
