"""Self-speculative drafter: target layers shared by reference, adapter-only artifacts."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from feedback.drafters.from_target import (
    SelfSpecConfig,
    assemble,
    selfspec_adapter_from_target,
)
from feedback.registry.artifact import (
    WEIGHTS_FILE,
    DrafterArtifactError,
    load_drafter,
    save_drafter,
)
from serving.drafters import build_drafter
from serving.drafters.base import DraftRequestView
from serving.target import tiny_target

V, H, E = 256, 64, 2


@pytest.fixture(scope="module")
def target():
    return tiny_target(vocab_size=V, hidden_size=H, num_layers=5, seed=0)


def vocab(n=96):
    return torch.arange(0, 2 * n, 2)  # sorted, every other id


def test_day0_next_init_is_the_target_exited_early(target):
    adapter = selfspec_adapter_from_target(target.model, exit_layer=E, draft_vocab=vocab())
    model = assemble(adapter, target.model)
    ids = torch.randint(0, V, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hs = target.model(ids, output_hidden_states=True).hidden_states
        # hidden_states[E + 1] is the output of layer E: the target cut after E + 1 layers
        want = F.linear(target.model.model.norm(hs[E + 1]), target.model.lm_head.weight)
        got = model(ids).logits
    assert torch.allclose(got, want, atol=1e-5)
    assert model.selfspec_draft_vocab.tolist() == vocab().tolist()


def test_frozen_parts_are_the_targets_own_tensors(target):
    adapter = selfspec_adapter_from_target(target.model, exit_layer=E, adapter_init="last")
    model = assemble(adapter, target.model)
    t = target.model.model
    assert model.model.embed_tokens is t.embed_tokens
    assert all(model.model.layers[i] is t.layers[i] for i in range(E))
    assert model.lm_head.weight.data_ptr() == t.embed_tokens.weight.data_ptr()
    # adapter copied from the last layer, not shared with it
    own = model.model.layers[E].mlp.up_proj.weight
    assert own.data_ptr() != t.layers[-1].mlp.up_proj.weight.data_ptr()
    assert torch.equal(own, t.layers[-1].mlp.up_proj.weight)


def test_artifact_holds_only_the_adapter_and_round_trips(target, tmp_path):
    from safetensors import safe_open

    adapter = selfspec_adapter_from_target(target.model, exit_layer=E, draft_vocab=vocab())
    with torch.no_grad():
        adapter.layers[0].mlp.down_proj.weight.add_(0.01)
    model = assemble(adapter, target.model)
    save_drafter(model, adapter.config, target.fingerprint, tmp_path / "a", version="v1")
    with safe_open(str(tmp_path / "a" / WEIGHTS_FILE), "pt") as f:
        names = list(f.keys())
    assert names and all(n.startswith(("layers.0.", "norm.", "draft_vocab")) for n in names)
    loaded, meta = load_drafter(tmp_path / "a", target.fingerprint)
    assert meta.kind == "selfspec" and isinstance(meta.model_cfg(), SelfSpecConfig)
    for name, t in adapter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name
    drafter = build_drafter("selfspec", target, tmp_path / "a")
    assert drafter.kind == "selfspec" and drafter.version == "v1"
    ids = torch.randint(0, V, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(drafter.model(ids).logits, model(ids).logits)


def test_wrong_target_and_bad_vocab_are_refused(target, tmp_path):
    adapter = selfspec_adapter_from_target(target.model, exit_layer=E, draft_vocab=vocab())
    save_drafter(adapter, adapter.config, target.fingerprint, tmp_path / "a", version="v1")
    other = tiny_target(vocab_size=V, hidden_size=H, num_layers=5, seed=1)
    with pytest.raises(DrafterArtifactError, match="refusing"):
        build_drafter("selfspec", other, tmp_path / "a")
    shallow = tiny_target(vocab_size=V, hidden_size=H, num_layers=3, seed=0)
    with pytest.raises(ValueError, match="num_hidden_layers"):
        assemble(adapter, shallow.model)
    with pytest.raises(ValueError, match="sorted"):
        adapter.set_draft_vocab(vocab().flip(0))
    unsorted = adapter.state_dict()
    unsorted["draft_vocab"] = vocab().flip(0)
    from safetensors.torch import save_file

    from feedback.registry.artifact import sha256_file

    bad = tmp_path / "bad"
    save_drafter(adapter, adapter.config, target.fingerprint, bad, version="v2")
    save_file({k: v.contiguous() for k, v in unsorted.items()}, str(bad / WEIGHTS_FILE))
    import json

    meta = json.loads((bad / "config.json").read_text())
    meta["files"][WEIGHTS_FILE] = sha256_file(bad / WEIGHTS_FILE)
    (bad / "config.json").write_text(json.dumps(meta))
    with pytest.raises(DrafterArtifactError, match="sorted"):
        load_drafter(bad, target.fingerprint)


def test_drafter_proposes_the_assembled_models_greedy_chain_in_its_vocab(target):
    drafter = build_drafter("selfspec", target, exit_layer=E, draft_vocab_size=128, branches=1)  # a chain
    dv = drafter.model.selfspec_draft_vocab
    seq = torch.randint(0, V, (11,), generator=torch.Generator().manual_seed(2)).tolist()
    drafter.add_request(DraftRequestView("r", list(seq), len(seq) - 2), None)
    p = drafter.propose([DraftRequestView("r", list(seq), len(seq) - 2)], 3)
    want, cur = [], list(seq)
    with torch.no_grad():
        for _ in range(3):
            logits = drafter.model(torch.tensor([cur])).logits[0, -1, dv]  # [Vd]
            tok = int(dv[logits.argmax()])
            want.append(tok)
            cur.append(tok)
    assert p.tokens[0, : int(p.lengths[0])].tolist() == want[: int(p.lengths[0])]
    assert int(p.lengths[0]) == 3
    assert np.isin(p.tokens[0].numpy(), dv.numpy()).all()


def test_student_trains_only_the_adapter(target):
    from trainer.students import SelfSpecStudent

    adapter = selfspec_adapter_from_target(target.model, exit_layer=E, draft_vocab=vocab(128))
    model = assemble(adapter, target.model)
    student = SelfSpecStudent(model, adapter.config)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith((f"model.layers.{E}.", "model.norm.")) for n in trainable)
    frozen_before = target.model.model.layers[0].mlp.up_proj.weight.clone()
    ids = torch.randint(0, V, (2, 10))
    loss = student.model(ids).logits[..., student.head_vocab].logsumexp(-1).mean()
    loss.backward()
    assert target.model.model.layers[0].mlp.up_proj.weight.grad is None
    assert model.model.layers[E].mlp.up_proj.weight.grad is not None
    assert torch.equal(target.model.model.layers[0].mlp.up_proj.weight, frozen_before)
