"""A selfspec student runs its frozen (target) layers once per replayed sequence: the logits, the
held-out scores and the training steps are those of the full forward (its last layer computed at the
read rows only); champion snapshots and checkpoints copy and keep the trained tensors only."""

import copy

import numpy as np
import pytest
import torch
from trainer_tracegen import VOCAB, make_trace

from trainer.distill import DistillConfig, Distiller
from trainer.examples import build_examples
from trainer.frozen_prefix import FrozenPrefixCache
from trainer.packing import pack_examples
from trainer.students import SelfSpecStudent, StandaloneStudent


def _target(seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).eval()


def _selfspec(target, draft_vocab=None, adapter_layers: int = 1) -> SelfSpecStudent:
    from feedback.drafters.from_target import assemble, selfspec_adapter_from_target

    adapter = selfspec_adapter_from_target(target, exit_layer=2, adapter_layers=adapter_layers, draft_vocab=draft_vocab)
    return SelfSpecStudent(assemble(adapter.float(), target), adapter.config)


class FullForward(StandaloneStudent):
    """The model's own Hugging Face forward: every layer at every position, on every call."""

    def _hidden_at(self, seqs, ids, pos, mask, b_idx, t_idx):
        return self.model.model(input_ids=ids, position_ids=pos, attention_mask=mask).last_hidden_state[b_idx, t_idx]


def _full_forward(st: SelfSpecStudent) -> StandaloneStudent:
    return FullForward(st.model, head_vocab=st.head_vocab, train_embeddings=False)


def _records(n: int, seed0: int = 0):
    return [make_trace("a", seed=seed0 + i, prompt_len=10, out_len=24, k=3) for i in range(n)]


@pytest.mark.parametrize(("draft_vocab", "adapter_layers"), [(None, 1), (torch.arange(0, VOCAB, 2), 1), (None, 2)])
def test_rows_and_scores_equal_the_full_forward_and_the_frozen_layers_run_once(draft_vocab, adapter_layers):
    """The adapter's last layer runs at the read rows only (trainer/partial_forward.py)."""
    st = _selfspec(_target(), draft_vocab, adapter_layers)
    ref = _full_forward(st)
    recs = _records(3)
    examples = [ex for r in recs for ex in build_examples(r)]
    with torch.no_grad():
        want = ref.row_batch(examples)
        got = st.row_batch(examples)
        assert st.prefix.misses == len(pack_examples(examples)) and st.prefix.hits == 0
        # another batch of the same traces (as a replay draws them): every sequence is kept
        again = st.row_batch([ex for r in recs[::-1] for ex in build_examples(r)])
    assert st.prefix.hits == st.prefix.misses
    torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=1e-4)
    assert torch.equal(got.topk_ids, want.topk_ids)
    assert again.logits.shape == got.logits.shape
    for max_len in (512, 20):  # 20: left-truncated into the output (prompt 10 + output 24 tokens)
        st.max_len = ref.max_len = max_len
        for rec in _records(2, seed0=50):  # held-out: overlaps and accepted lengths as the full forward's
            a, b = st.evaluate(rec, k=3, branches=2), ref.evaluate(rec, k=3, branches=2)
            np.testing.assert_allclose(a.overlap, b.overlap, atol=1e-5)
            assert np.array_equal(a.accept_at, b.accept_at) and len(a.accept_at) == 24


def test_training_with_the_cache_takes_the_full_forwards_steps():
    """Same seeds, same batches: the adapter's weights after a few steps match a student whose
    frozen layers ran every step, and the target's layers never move."""
    target = _target(1)
    frozen_before = copy.deepcopy(target.model.layers[0].state_dict())
    st = _selfspec(target)
    ref = _full_forward(copy.deepcopy(st))
    recs = _records(4, seed0=10)
    a = Distiller(st, DistillConfig(lr=1e-2, precision="fp32"))
    b = Distiller(ref, DistillConfig(lr=1e-2, precision="fp32"))
    for _ in range(3):
        a.step(recs)
        b.step(recs)
    assert st.prefix.hits > 0
    for (n, p), (_, q) in zip(st.model.named_parameters(), ref.model.named_parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4, msg=n)
    adapter = st.model.model.layers[2].mlp.up_proj.weight
    assert not torch.allclose(adapter, _selfspec(_target(1)).model.model.layers[2].mlp.up_proj.weight)
    for n, t in target.model.layers[0].state_dict().items():
        assert torch.equal(t, frozen_before[n]), n


def test_champion_snapshots_share_frozen_tensors_and_the_cache_and_keep_their_own_adapter():
    st = _selfspec(_target())
    champion = st.snapshot()  # what the loop keeps for each promotion
    assert champion.prefix is st.prefix and copy.deepcopy(st).prefix is st.prefix
    shared = dict(champion.model.named_parameters())
    for n, p in st.model.named_parameters():
        assert (shared[n] is p) == (not p.requires_grad), n
    rec = _records(1)[0]
    st.evaluate(rec, k=3)
    champion.evaluate(rec, k=3)  # the champion's frozen layers are the student's: a hit
    assert st.prefix.misses == 1 and st.prefix.hits == 1
    kept = {n: p.detach().clone() for n, p in champion.model.named_parameters() if p.requires_grad}
    Distiller(st, DistillConfig(lr=1e-2, precision="fp32")).step(_records(2, seed0=30))
    moved = [n for n, p in st.model.named_parameters() if p.requires_grad and not torch.equal(p, kept[n])]
    assert moved and all(torch.equal(p, kept[n]) for n, p in champion.model.named_parameters() if n in kept)
    champion.load_trainable(dict(st.model.state_dict()))  # a checkpoint's champion, restored
    assert all(torch.equal(p, q) for p, q in zip(champion.model.parameters(), st.model.parameters()))


def test_the_cache_keeps_recent_sequences_within_its_budget():
    cache = FrozenPrefixCache(max_bytes=3 * 10 * 32 * 4)  # three 10-token sequences of width 32 (fp32)
    seqs = pack_examples([build_examples(r, include_discard=False)[0] for r in _records(4, seed0=20)])
    calls = []

    def compute(missing):
        calls.append(len(missing))
        return torch.randn(len(missing), max(len(s.tokens) for s in missing), 32)

    for s in seqs:
        s.tokens, s.positions, s.sees_main, s.branch = (a[:10] for a in (s.tokens, s.positions, s.sees_main, s.branch))
    first = cache.outputs(seqs, compute)
    assert calls == [4] and len(cache) == 3 and cache.bytes <= cache.max_bytes
    again = cache.outputs(seqs[1:], compute)  # the oldest was evicted, the rest are kept
    assert calls == [4] and all(torch.equal(x, y) for x, y in zip(again, first[1:]))
    cache.outputs(seqs[:1], compute)
    assert calls == [4, 1]


def test_checkpoints_keep_the_trained_tensors_only_and_restore_them(tmp_path):
    from trainer import checkpoint
    from trainer.replay import ReplayBuffer

    st = _selfspec(_target(2))
    d = Distiller(st, DistillConfig(lr=1e-2, precision="fp32"))
    d.step(_records(3, seed0=40))
    path = checkpoint.save(tmp_path, d, ReplayBuffer(heldout_fraction=0.0), {},
                           champion_state=st.snapshot().trainable_state())
    trained = {n for n, p in st.model.named_parameters() if p.requires_grad}
    assert set(torch.load(path / "distiller.pt", weights_only=True)["model"]) == trained  # no target tensor
    assert set(checkpoint.champion_state(path)) == trained
    fresh = _selfspec(_target(2))  # a restarted trainer: the same target, a day-0 adapter
    checkpoint.load(path, Distiller(fresh, DistillConfig(precision="fp32")), ReplayBuffer(heldout_fraction=0.0))
    assert all(torch.equal(p, q) for p, q in zip(fresh.model.parameters(), st.model.parameters()))
    with pytest.raises(ValueError, match="trained tensors"):
        fresh.load_trainable({})  # a state without the adapter is refused, not half-loaded
