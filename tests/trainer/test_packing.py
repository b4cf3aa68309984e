"""Packing discarded branches onto their main sequence changes the cost, never the logits."""

import numpy as np
import torch
from trainer_tracegen import make_trace, tiny_lm

from trainer.examples import build_examples
from trainer.packing import pack_examples
from trainer.students import StandaloneStudent


def _both(examples):
    st = StandaloneStudent(tiny_lm(seed=3))
    st.model.eval()
    with torch.no_grad():
        packed = st.row_batch(examples)
        plain = st._row_batch_unpacked([ex for s in pack_examples(examples) for ex in s.examples])
    return packed, plain


def test_packed_rows_match_separate_forwards():
    recs = [make_trace("a", seed=s, out_len=30, k=3) for s in range(3)]
    examples = [ex for r in recs for ex in build_examples(r)]
    seqs = pack_examples(examples)
    assert len(seqs) == len(recs)  # every branch found its main sequence
    assert sum(len(s.tokens) for s in seqs) < sum(len(e.tokens) for e in examples) / 2
    packed, plain = _both(examples)
    assert packed.logits.shape == plain.logits.shape
    torch.testing.assert_close(packed.logits, plain.logits, atol=1e-5, rtol=1e-4)
    assert torch.equal(packed.topk_ids, plain.topk_ids) and torch.equal(packed.discard, plain.discard)


def test_branches_without_their_main_or_cut_differently_stay_separate():
    rec = make_trace("b", seed=7, prompt_len=20, out_len=30, k=3)
    exs = build_examples(rec, max_len=32)  # left truncation shifts main and branches differently
    only_branches = [e for e in build_examples(make_trace("a", seed=8, out_len=20, k=3)) if e.discard]
    examples = exs + only_branches
    seqs = pack_examples(examples)
    assert sum(len(s.examples) for s in seqs) == len(examples)
    packed, plain = _both(examples)
    torch.testing.assert_close(packed.logits, plain.logits, atol=1e-5, rtol=1e-4)
    assert np.isfinite(packed.logits.numpy()).all()


def test_head_vocab_reads_only_those_rows_and_frozen_embeddings_stay_put():
    from trainer.distill import DistillConfig, Distiller

    rec = make_trace("a", seed=11, out_len=20, k=3)
    examples = build_examples(rec)
    vocab = torch.arange(0, 48, 2)  # every other target id
    full = StandaloneStudent(tiny_lm(seed=4))
    sub = StandaloneStudent(tiny_lm(seed=4), head_vocab=vocab, train_embeddings=False)
    with torch.no_grad():
        a, b = full.row_batch(examples), sub.row_batch(examples)
    torch.testing.assert_close(b.logits, a.logits[:, vocab], atol=1e-5, rtol=1e-4)
    assert torch.equal(b.topk_ids, sub.to_draft_ids(a.topk_ids))  # odd ids fall outside: -1
    assert (b.topk_ids[a.topk_ids % 2 == 1] == -1).all()
    emb = sub.model.get_input_embeddings().weight.clone()
    layer = sub.model.model.layers[0].mlp.up_proj.weight.clone()
    Distiller(sub, DistillConfig(lr=1e-2)).step([rec])
    assert torch.equal(sub.model.get_input_embeddings().weight, emb)
    assert not torch.equal(sub.model.model.layers[0].mlp.up_proj.weight, layer)
