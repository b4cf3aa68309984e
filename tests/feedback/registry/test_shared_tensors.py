"""Artifacts leave the tensors a drafter keeps as the target's (its frozen embedding) to the
target: not stored, taken from the target at load, checked by digest, shared in memory."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from feedback.drafters.standalone_lm import StandaloneConfig, standalone_from_target
from feedback.registry.artifact import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    DrafterArtifactError,
    load_drafter,
    save_drafter,
)
from feedback.registry.shared_tensors import CheckpointTensors, TargetTensors, shared_with_target
from serving.target import tiny_target

V = 256
EMBED = "model.embed_tokens.weight"


@pytest.fixture(scope="module")
def target():
    return tiny_target(vocab_size=V, hidden_size=64, num_layers=4, seed=3)


def _frozen_drafter(target, layers=2):
    """A standalone drafter cut from the target with its embedding frozen, as the trainer's
    student keeps it, and its layers trained away from the target's."""
    model = standalone_from_target(target.model, num_layers=layers)
    model.get_input_embeddings().weight.requires_grad_(False)
    with torch.no_grad():
        for p in model.model.layers.parameters():
            p.add_(0.01 * torch.randn_like(p))
    return model, StandaloneConfig.for_target(target.model.config, num_layers=layers, vocab_size=V)


def test_the_frozen_embedding_is_left_to_the_target_and_shared_again_at_load(target, tmp_path):
    model, cfg = _frozen_drafter(target)
    shared = shared_with_target(model, target.model)
    assert list(shared) == [EMBED]  # trained layers and the trainable norm are the drafter's own
    meta = save_drafter(model, cfg, target.fingerprint, tmp_path / "a", version="v1", from_target=shared)
    stored = load_file(str(tmp_path / "a" / WEIGHTS_FILE))
    assert EMBED not in stored and "lm_head.weight" not in stored
    assert meta.from_target == shared
    full = save_drafter(model, cfg, target.fingerprint, tmp_path / "b", version="v1")
    assert (tmp_path / "a" / WEIGHTS_FILE).stat().st_size < (tmp_path / "b" / WEIGHTS_FILE).stat().st_size
    assert not full.from_target

    loaded, _ = load_drafter(tmp_path / "a", target.fingerprint, target_tensors=TargetTensors(target.model.state_dict()))
    theirs = target.model.get_input_embeddings().weight
    assert loaded.model.embed_tokens.weight.data_ptr() == theirs.data_ptr()  # no copy
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight  # still tied
    assert not loaded.model.embed_tokens.weight.requires_grad
    ids = torch.randint(0, V, (2, 9))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_an_artifact_that_needs_the_target_is_refused_without_it_or_with_other_weights(target, tmp_path):
    model, cfg = _frozen_drafter(target)
    save_drafter(model, cfg, target.fingerprint, tmp_path / "a", version="v1",
                 from_target=shared_with_target(model, target.model))
    with pytest.raises(DrafterArtifactError, match="load it with the target's tensors"):
        load_drafter(tmp_path / "a", target.fingerprint)
    other = dict(target.model.state_dict())  # a target of the same fingerprint on other weights
    other[EMBED] = other[EMBED] + 1e-3
    with pytest.raises(DrafterArtifactError, match=f"whose {EMBED} differs"):
        load_drafter(tmp_path / "a", target.fingerprint, target_tensors=TargetTensors(other))


def test_a_tensor_that_changed_since_it_was_the_targets_is_stored(target, tmp_path):
    model, cfg = _frozen_drafter(target)
    shared = shared_with_target(model, target.model)
    with torch.no_grad():
        model.get_input_embeddings().weight[5] += 1.0  # no longer the target's
    meta = save_drafter(model, cfg, target.fingerprint, tmp_path / "a", version="v1", from_target=shared)
    assert not meta.from_target and EMBED in load_file(str(tmp_path / "a" / WEIGHTS_FILE))
    loaded, _ = load_drafter(tmp_path / "a", target.fingerprint)
    assert torch.equal(loaded.model.embed_tokens.weight, model.model.embed_tokens.weight)


def test_a_shared_name_the_drafter_lacks_is_refused(target, tmp_path):
    model, cfg = _frozen_drafter(target)
    save_drafter(model, cfg, target.fingerprint, tmp_path / "a", version="v1",
                 from_target=shared_with_target(model, target.model))
    meta = json.loads((tmp_path / "a" / CONFIG_FILE).read_text())
    meta["from_target"]["model.layers.9.mlp.up_proj.weight"] = "0" * 64
    (tmp_path / "a" / CONFIG_FILE).write_text(json.dumps(meta))
    with pytest.raises(DrafterArtifactError, match="unexpected.*layers.9"):
        load_drafter(tmp_path / "a", target.fingerprint, target_tensors=TargetTensors(target.model.state_dict()))


def test_the_trainers_student_exports_without_its_embedding_and_serving_drafts_with_the_targets(target, tmp_path):
    from infra.day0 import make_student
    from serving.drafters.factory import build_drafter
    from trainer.export import artifact_exporter

    student = make_student(target, draft_vocab_size=64)
    assert list(student.from_target) == [EMBED]
    cfg = StandaloneConfig.for_target(target.model.config)
    artifact_exporter(cfg)(student, tmp_path / "a", target.fingerprint, {})
    assert EMBED not in load_file(str(tmp_path / "a" / WEIGHTS_FILE))
    drafter = build_drafter("standalone", target, tmp_path / "a")
    emb = drafter.model.get_input_embeddings().weight
    assert emb.data_ptr() == target.model.get_input_embeddings().weight.data_ptr()  # no copy in serving


def test_sglangs_loader_reads_the_shared_tensor_from_the_target_checkpoint(target, tmp_path):
    from serving.sglang.drafts import SGLangDraftLoader

    model, cfg = _frozen_drafter(target, layers=1)
    save_drafter(model, cfg, target.fingerprint, tmp_path / "a", version="v1",
                 from_target=shared_with_target(model, target.model))
    target.model.save_pretrained(tmp_path / "target")
    assert EMBED in CheckpointTensors(tmp_path / "target")
    engine = SimpleNamespace(fingerprint=target.fingerprint, drafter=SimpleNamespace(kind="standalone"),
                             config=SimpleNamespace(model_path=str(tmp_path / "target")))
    names = dict(SGLangDraftLoader(engine).load(tmp_path / "a").named_tensors())
    assert torch.equal(names[EMBED], target.model.get_input_embeddings().weight)  # a full update, as before
    for name, t in model.state_dict().items():
        assert torch.equal(names[name], t), name


def test_servings_day0_standalone_drafter_holds_the_targets_tensors_not_copies(target):
    from serving.drafters.factory import build_drafter

    drafter = build_drafter("standalone", target, num_layers=2)
    mine, theirs = dict(drafter.model.named_parameters()), dict(target.model.named_parameters())
    for name in (EMBED, "model.layers.1.mlp.up_proj.weight", "model.norm.weight"):
        assert mine[name].data_ptr() == theirs[name].data_ptr(), name
    ids = torch.randint(0, V, (2, 9))
    with torch.no_grad():
        assert torch.equal(drafter.model(ids).logits, standalone_from_target(target.model, num_layers=2)(ids).logits)
    random = build_drafter("standalone", target, num_layers=1, init="random")
    assert random.model.get_input_embeddings().weight.data_ptr() != theirs[EMBED].data_ptr()


def test_a_sharded_checkpoints_tensors_are_found_through_its_index(target, tmp_path):
    target.model.save_pretrained(tmp_path / "sharded", max_shard_size="50KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    tensors = CheckpointTensors(tmp_path / "sharded")
    assert torch.equal(tensors[EMBED], target.model.get_input_embeddings().weight)
    assert len(tensors) >= len(list(target.model.parameters())) - 1  # a tied lm_head is stored once
