"""PackedDraftNet: learned drafts on the target's decode path (packed panels, native attention).
With bf16 panels the layers shared with the target are the target's own panels; with int8 panels
(the default, ``DRAFT_INT8``) every projection and the head are the drafter's own int8 copies,
and the drafts are those of the model at its int8 weights."""

import copy

import pytest
import torch

from kernels.packed_linear import PackedLinear
from serving.drafters import build_drafter
from serving.drafters import standalone as standalone_mod
from serving.drafters.base import DraftRequestView
from serving.drafters.standalone import PackedDraftNet
from serving.engine.forward_cache import existing_forward
from serving.engine.model_runner import ModelRunner
from serving.target import tiny_target

V, K = 256, 4
pytestmark = pytest.mark.skipif(
    not PackedDraftNet.supports(tiny_target(vocab_size=V, hidden_size=64).model),
    reason="native kernels not built",
)


@pytest.fixture
def bf16_panels(monkeypatch):
    """Draft nets built with bf16 panels (``DRAFT_INT8`` off)."""
    monkeypatch.setattr(standalone_mod, "DRAFT_INT8", False)


def _bf16_target(seed: int):
    """A tiny target whose weights are exactly bf16, as SmolLM2's are (so the packed panels hold
    them exactly and the drafts can be compared with the model's own fp32 forward)."""
    target = tiny_target(vocab_size=V, hidden_size=64, num_layers=4, seed=seed)
    with torch.no_grad():
        for p in target.model.parameters():
            p.copy_(p.bfloat16().float())
    return target


def _selfspec(target):
    return build_drafter("selfspec", target, exit_layer=2, adapter_layers=1, draft_vocab_size=128, branches=1)


def _propose(drafter, seqs):
    for rid, seq in seqs.items():
        drafter.add_request(DraftRequestView(rid, list(seq), len(seq) - 1))
    views = [DraftRequestView(rid, list(seq), len(seq) - 1) for rid, seq in seqs.items()]
    return drafter.propose(views, K)


def _reference(model, vocab_map, seq, rounds: bool):
    """Greedy drafts and their probabilities from the assembled model's own (HF) forward; with
    ``rounds``, every projection's input rounded to bf16 first, as the drafter's AMX path reads
    it (``PackedLinear.rounded``)."""
    seq, toks, probs = list(seq), [], []
    hooks = [m.register_forward_pre_hook(lambda _, a: (a[0].bfloat16().float(),))
             for m in model.modules() if rounds and isinstance(m, torch.nn.Linear)]
    try:
        with torch.no_grad():
            for _ in range(K):
                q = model(torch.tensor([seq])).logits[0, -1][vocab_map].float().softmax(-1)  # [Vd]
                i = int(q.argmax())
                toks.append(int(vocab_map[i]))
                probs.append(float(q[i]))
                seq.append(toks[-1])
    finally:
        for h in hooks:
            h.remove()
    return toks, probs


def _rounds(net) -> bool:
    """Whether the drafter's projections round their inputs to bf16 (on AMX tiles)."""
    return bool(getattr(net.forward.lm_head_served, "rounds_activations", False))


def _panels(layer):
    """The tensors a served layer reads (norm weights and packed panels)."""
    return [getattr(w, "panels", w) for w in layer]


def _seqs():
    g = torch.Generator().manual_seed(7)
    return {f"r{i}": torch.randint(0, V, (n,), generator=g).tolist() for i, n in enumerate((9, 23, 4))}


def test_selfspec_drafts_read_the_targets_own_panels_and_match_its_forward(bf16_panels):
    target = _bf16_target(seed=3)
    runner = ModelRunner(target.model, target.device)  # the engine packs the target first
    assert runner.fast is not None and existing_forward(target.model) is runner.fast
    drafter = _selfspec(target)
    net = drafter.net
    assert isinstance(net, PackedDraftNet)
    # Layers 0-1 are the target's: the very panels the engine reads, not a copy; the adapter is
    # the drafter's own.
    for i in range(2):
        assert all(a is b for a, b in zip(_panels(net.forward.layers[i]), _panels(runner.fast.layers[i])))
    assert _panels(net.forward.layers[2])[1] is not _panels(runner.fast.layers[2])[1]
    assert net.forward.lm_head_served.out_features == 128  # the lm_head is read at the draft vocabulary only

    seqs = _seqs()
    p = _propose(drafter, seqs)
    assert p.lengths.tolist() == [K] * len(seqs)
    for row, seq in enumerate(seqs.values()):
        toks, probs = _reference(drafter.model, net.vocab_map, seq, _rounds(net))
        assert p.tokens[row].tolist() == toks
        torch.testing.assert_close(p.probs[row], torch.tensor(probs), rtol=1e-4, atol=1e-5)


def test_a_drafter_built_before_the_engine_packs_its_own_layers_and_drafts_the_same(bf16_panels):
    target = _bf16_target(seed=4)
    assert existing_forward(target.model) is None
    alone = _selfspec(target)  # nothing to share yet: its own panels of layers 0-1
    runner = ModelRunner(target.model, target.device)
    shared = _selfspec(target)
    assert _panels(alone.net.forward.layers[0])[1] is not _panels(runner.fast.layers[0])[1]
    assert _panels(shared.net.forward.layers[0])[1] is _panels(runner.fast.layers[0])[1]
    a, b = _propose(alone, _seqs()), _propose(shared, _seqs())
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.probs, b.probs)


def test_a_trained_standalone_drafter_drafts_through_bf16_roundings(bf16_panels):
    """Weights that are not exactly bf16 (a trained student's) are packed rounded: half the bytes;
    the drafts are those of the model with its weights rounded, the target's output untouched."""
    target = tiny_target(vocab_size=V, hidden_size=64, num_layers=4, seed=5)
    drafter = build_drafter("standalone", target, init="random", seed=1, branches=1)
    rounded = drafter.model
    reference = type(rounded)(rounded.config)
    reference.load_state_dict({k: v.bfloat16().float() for k, v in rounded.state_dict().items()})
    reference.eval()
    seqs = _seqs()
    p = _propose(drafter, seqs)
    for row, seq in enumerate(seqs.values()):
        toks, _ = _reference(reference, torch.arange(V), seq, _rounds(drafter.net))
        assert p.tokens[row].tolist() == toks


def _at_int8(model):
    """A copy of ``model`` whose every projection and lm_head hold their int8 quantisations (q x
    s, one scale per output row, as ``PackedLinear.pack_int8`` packs them); the embedding as is."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for mod in ref.modules():
            if isinstance(mod, torch.nn.Linear):
                mod.weight = torch.nn.Parameter(PackedLinear.pack_int8(mod.weight.float()).unpacked())
    return ref.eval()


def test_int8_drafts_are_the_models_own_at_its_int8_weights_and_leave_the_target_alone():
    target = _bf16_target(seed=6)
    runner = ModelRunner(target.model, target.device)
    drafter = _selfspec(target)
    net = drafter.net
    assert standalone_mod.DRAFT_INT8 and isinstance(net, PackedDraftNet)
    for i in range(3):  # shared layers too: the drafter's own int8 copies, not the target's panels
        served = [w for w in net.forward.layers[i] if isinstance(w, PackedLinear)]
        assert served and all(w.layout == "int8" for w in served)
        assert _panels(net.forward.layers[i])[1] is not _panels(runner.fast.layers[i])[1]
    assert net.forward.lm_head_served.layout == "int8" and net.forward.lm_head_served.out_features == 128
    assert all(w.layout != "int8" for lay in runner.fast.layers for w in lay if isinstance(w, PackedLinear))
    # half the bytes of the bf16 panels (plus a scale per output)
    int8_bytes = net.forward.lm_head_served.nbytes
    assert int8_bytes < 0.6 * PackedLinear.pack(net.forward.lm_head_served.unpacked()).nbytes

    seqs = _seqs()
    p = _propose(drafter, seqs)
    reference = _at_int8(drafter.model)
    for row, seq in enumerate(seqs.values()):
        toks, probs = _reference(reference, net.vocab_map, seq, rounds=False)
        assert p.tokens[row].tolist() == toks
        # the kernel scales each output's sum once; the reference multiplies every weight first
        torch.testing.assert_close(p.probs[row], torch.tensor(probs), rtol=1e-3, atol=1e-4)


def test_a_drafter_on_bf16_attention_keeps_a_bf16_cache_and_drafts_the_same(monkeypatch):
    """Heads of 64 on a CPU with AVX-512 BF16: the drafter's attention reads bf16 operands, so its
    rows' KV buffers hold bf16 (rounded once, when written), and its drafts are bit for bit those
    it makes on fp32 buffers."""
    target = tiny_target(vocab_size=V, hidden_size=256, num_layers=4, seed=6)  # 4 heads of 64
    drafter = _selfspec(target)
    net = drafter.net
    if not net.forward.bf16_attention:
        pytest.skip("no bf16 attention here (AVX-512 BF16)")
    assert net.kv_dtype == torch.bfloat16
    seqs = _seqs()
    on_bf16 = _propose(drafter, seqs)
    assert drafter._states["r0"].keys[0].dtype == torch.bfloat16
    monkeypatch.setattr(net, "kv_dtype", torch.float32)
    on_fp32 = _propose(drafter, seqs)  # the same requests again, on fp32 buffers
    assert drafter._states["r0"].keys[0].dtype == torch.float32
    assert torch.equal(on_bf16.tokens, on_fp32.tokens) and torch.equal(on_bf16.probs, on_fp32.probs)
