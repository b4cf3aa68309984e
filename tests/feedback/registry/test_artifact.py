import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from feedback.drafters.eagle_head import EagleHead, eagle_from_target
from feedback.drafters.standalone_lm import StandaloneConfig, standalone_from_target
from feedback.registry.artifact import (
    CONFIG_FILE,
    DRAFT_VOCAB_FILE,
    WEIGHTS_FILE,
    DrafterArtifactError,
    load_drafter,
    read_meta,
    save_drafter,
    sha256_file,
)
from feedback.target.fingerprint import TargetFingerprint
from serving.target import tiny_target

V = 256


@pytest.fixture(scope="module")
def target():
    return tiny_target(vocab_size=V, hidden_size=64, num_layers=4, dtype=torch.bfloat16)


@pytest.fixture()
def eagle(target):
    vocab = torch.tensor(sorted({*range(40), 97, 255}))
    return eagle_from_target(target.model, draft_vocab=vocab, feature_layers=(1, 2, 3))


def _rewrite_weights(path, edit):
    """Edit the stored tensors and fix the recorded checksum (a consistent but bad artifact)."""
    state = load_file(str(path / WEIGHTS_FILE))
    edit(state)
    save_file(state, str(path / WEIGHTS_FILE))
    meta = json.loads((path / CONFIG_FILE).read_text())
    meta["files"][WEIGHTS_FILE] = sha256_file(path / WEIGHTS_FILE)
    (path / CONFIG_FILE).write_text(json.dumps(meta))


def test_eagle_round_trip_is_bit_identical(target, eagle, tmp_path):
    meta = save_drafter(
        eagle,
        eagle.config,
        target.fingerprint,
        tmp_path / "a",
        version="v2",
        parent_version="v1",
        extra={"offsets": [1, 2]},
    )
    loaded, meta2 = load_drafter(tmp_path / "a", expected_fingerprint=target.fingerprint)
    assert isinstance(loaded, EagleHead) and loaded.config == eagle.config
    a, b = eagle.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    assert torch.equal(loaded.draft_vocab(), eagle.draft_vocab())
    assert meta2.version == "v2" and meta2.parent_version == "v1" and meta2.kind == "eagle"
    assert meta2.target == target.fingerprint and meta2.files == meta.files
    assert meta2.draft_vocab_size == 42 and meta2.extra == {"offsets": [1, 2]}
    assert loaded.embed_weight is None  # the target's embedding is attached by the caller


def test_standalone_round_trip_keeps_tied_weights(target, tmp_path):
    model = standalone_from_target(target.model, num_layers=2)
    cfg = StandaloneConfig.for_target(target.model.config, num_layers=2, vocab_size=V)
    save_drafter(model, cfg, target.fingerprint, tmp_path / "s", version="v1")
    stored = load_file(str(tmp_path / "s" / WEIGHTS_FILE))
    assert (
        "lm_head.weight" not in stored or "model.embed_tokens.weight" not in stored
    )  # tied: stored once
    loaded, meta = load_drafter(tmp_path / "s", expected_fingerprint=target.fingerprint)
    assert meta.kind == "standalone"
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    for name, t in model.state_dict().items():
        assert torch.equal(t, loaded.state_dict()[name]), name
    ids = torch.randint(0, V, (1, 7))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)


def test_standalone_records_the_draft_vocabulary_it_was_trained_at(target, tmp_path):
    model = standalone_from_target(target.model, num_layers=2)
    cfg = StandaloneConfig.for_target(target.model.config, num_layers=2, vocab_size=V)
    vocab = torch.tensor(sorted({*range(60), 200, 255}))
    meta = save_drafter(model, cfg, target.fingerprint, tmp_path / "s", version="v1", draft_vocab=vocab)
    assert meta.draft_vocab_size == 62 and DRAFT_VOCAB_FILE in meta.files
    loaded, _ = load_drafter(tmp_path / "s", expected_fingerprint=target.fingerprint)
    assert torch.equal(loaded.artifact_draft_vocab, vocab)
    save_drafter(model, cfg, target.fingerprint, tmp_path / "full", version="v1")
    assert load_drafter(tmp_path / "full", expected_fingerprint=target.fingerprint)[0].artifact_draft_vocab is None


@pytest.mark.parametrize("bad", [torch.tensor([3, 2, 5]), torch.tensor([0, 1, V]), torch.tensor([[1, 2]]),
                                 torch.tensor([0.0, 1.0])])
def test_save_refuses_a_malformed_draft_vocabulary(target, tmp_path, bad):
    model = standalone_from_target(target.model, num_layers=2)
    cfg = StandaloneConfig.for_target(target.model.config, num_layers=2, vocab_size=V)
    with pytest.raises(ValueError, match="draft vocabulary"):
        save_drafter(model, cfg, target.fingerprint, tmp_path / "s", version="v1", draft_vocab=bad)
    assert not (tmp_path / "s").exists()


def test_a_tampered_or_missing_draft_vocabulary_is_refused(target, tmp_path):
    model = standalone_from_target(target.model, num_layers=2)
    cfg = StandaloneConfig.for_target(target.model.config, num_layers=2, vocab_size=V)
    save_drafter(model, cfg, target.fingerprint, tmp_path / "s", version="v1", draft_vocab=torch.arange(64))
    # Another, well-formed vocabulary with its checksum fixed: disagrees with config.json's sha256.
    save_file({"ids": torch.arange(1, 65)}, str(tmp_path / "s" / DRAFT_VOCAB_FILE))
    meta = json.loads((tmp_path / "s" / CONFIG_FILE).read_text())
    meta["files"][DRAFT_VOCAB_FILE] = sha256_file(tmp_path / "s" / DRAFT_VOCAB_FILE)
    (tmp_path / "s" / CONFIG_FILE).write_text(json.dumps(meta))
    with pytest.raises(DrafterArtifactError, match="differs from the one recorded"):
        load_drafter(tmp_path / "s", expected_fingerprint=target.fingerprint)
    # config.json records a vocabulary but the file is no longer listed
    del meta["files"][DRAFT_VOCAB_FILE]
    (tmp_path / "s" / CONFIG_FILE).write_text(json.dumps(meta))
    with pytest.raises(DrafterArtifactError, match="lists no"):
        load_drafter(tmp_path / "s", expected_fingerprint=target.fingerprint)


def test_artifact_for_another_target_is_refused_naming_both(target, eagle, tmp_path):
    save_drafter(eagle, eagle.config, target.fingerprint, tmp_path / "a", version="v1")
    other = TargetFingerprint(
        model_id="other-model", tokenizer_hash="ffff0000ffff0000", vocab_size=V
    )
    with pytest.raises(DrafterArtifactError) as err:
        load_drafter(tmp_path / "a", expected_fingerprint=other)
    msg = str(err.value)
    assert target.fingerprint.key() in msg and other.key() in msg


def test_corrupted_weights_are_refused(target, eagle, tmp_path):
    save_drafter(eagle, eagle.config, target.fingerprint, tmp_path / "a", version="v1")
    path = tmp_path / "a" / WEIGHTS_FILE
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(DrafterArtifactError, match="checksum"):
        load_drafter(tmp_path / "a", expected_fingerprint=target.fingerprint)


def test_nan_weights_are_refused(target, eagle, tmp_path):
    save_drafter(eagle, eagle.config, target.fingerprint, tmp_path / "a", version="v1")

    def poison(state):
        state["midlayer.mlp.up_proj.weight"][3, 5] = float("nan")

    _rewrite_weights(tmp_path / "a", poison)
    with pytest.raises(DrafterArtifactError, match="non-finite.*up_proj"):
        load_drafter(tmp_path / "a", expected_fingerprint=target.fingerprint)
    bad = eagle_from_target(target.model, draft_vocab_size=16)
    with torch.no_grad():
        bad.fc.weight[0, 0] = float("inf")
    with pytest.raises(ValueError, match="non-finite"):
        save_drafter(bad, bad.config, target.fingerprint, tmp_path / "b", version="v1")


def test_missing_tensor_is_refused(target, eagle, tmp_path):
    save_drafter(eagle, eagle.config, target.fingerprint, tmp_path / "a", version="v1")
    _rewrite_weights(tmp_path / "a", lambda state: state.pop("norm.weight"))
    with pytest.raises(DrafterArtifactError, match="missing.*norm.weight"):
        load_drafter(tmp_path / "a", expected_fingerprint=target.fingerprint)


def test_shapes_that_disagree_with_the_config_are_refused(target, eagle, tmp_path):
    save_drafter(eagle, eagle.config, target.fingerprint, tmp_path / "a", version="v1")
    meta = json.loads((tmp_path / "a" / CONFIG_FILE).read_text())
    meta["config"]["intermediate_size"] = 96
    (tmp_path / "a" / CONFIG_FILE).write_text(json.dumps(meta))
    with pytest.raises(DrafterArtifactError, match="shapes disagree"):
        load_drafter(tmp_path / "a", expected_fingerprint=target.fingerprint)


def test_inconsistent_draft_vocabulary_is_refused(target, eagle, tmp_path):
    save_drafter(eagle, eagle.config, target.fingerprint, tmp_path / "a", version="v1")

    def shift(state):
        state["t2d"][200] = True

    _rewrite_weights(tmp_path / "a", shift)
    with pytest.raises(DrafterArtifactError, match="t2d"):
        load_drafter(tmp_path / "a", expected_fingerprint=target.fingerprint)


def test_save_refuses_to_clobber_and_leaves_no_temp_dirs(target, eagle, tmp_path):
    save_drafter(eagle, eagle.config, target.fingerprint, tmp_path / "a", version="v1")
    with pytest.raises(FileExistsError):
        save_drafter(eagle, eagle.config, target.fingerprint, tmp_path / "a", version="v2")
    save_drafter(
        eagle, eagle.config, target.fingerprint, tmp_path / "a", version="v2", overwrite=True
    )
    assert read_meta(tmp_path / "a").version == "v2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [CONFIG_FILE, WEIGHTS_FILE]


def test_missing_config_is_refused(target, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DrafterArtifactError, match="config.json"):
        load_drafter(tmp_path / "empty", expected_fingerprint=target.fingerprint)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_any_nan_or_infinity_is_found_in_every_float_type(dtype, bad):
    from feedback.registry.artifact import _non_finite

    good = torch.randn(1000).to(dtype)
    poisoned = good.clone()
    poisoned[617] = bad
    assert _non_finite({"good": good, "bad": poisoned, "ids": torch.arange(5), "empty": torch.empty(0)}) == ["bad"]


def test_a_loaded_standalone_drafter_computes_what_was_saved_and_draws_no_random_numbers(target, tmp_path):
    """Loading builds the model without initialising its parameters (they are all overwritten):
    the global RNG is untouched and the loaded model, buffers included, equals the saved one."""
    model = standalone_from_target(target.model, num_layers=2)
    cfg = StandaloneConfig.for_target(target.model.config, num_layers=2, vocab_size=V)
    save_drafter(model, cfg, target.fingerprint, tmp_path / "s", version="v1")
    torch.manual_seed(123)
    expected_rng = torch.get_rng_state()
    loaded, _ = load_drafter(tmp_path / "s", expected_fingerprint=target.fingerprint)
    assert torch.equal(torch.get_rng_state(), expected_rng)
    ids = torch.randint(0, V, (2, 9))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_building_an_empty_model_leaves_other_threads_initialisation_alone():
    """The skip of parameter initialisation is a per-thread torch function mode: a layer built on
    another thread meanwhile is initialised as usual."""
    import threading

    from feedback.drafters.kinds import _SkipParameterInit

    built = {}
    with _SkipParameterInit():
        inside = torch.nn.Linear(64, 64)
        inside.weight.data.fill_(7.0)  # a fill that is no init: .data is not a Parameter
        t = threading.Thread(target=lambda: built.setdefault("other", torch.nn.Linear(64, 64)))
        t.start()
        t.join()
        torch.nn.init.zeros_(inside.weight)  # skipped: the parameter keeps its values
    assert torch.all(inside.weight == 7.0)
    other = built["other"].weight
    assert other.abs().max() > 0 and other.std() > 0.01  # kaiming-uniform, not left empty


def test_a_config_that_is_not_text_is_refused(target, tmp_path):
    model = standalone_from_target(target.model, num_layers=1)
    cfg = StandaloneConfig.for_target(target.model.config, num_layers=1, vocab_size=V)
    save_drafter(model, cfg, target.fingerprint, tmp_path / "s", version="v1")
    (tmp_path / "s" / CONFIG_FILE).write_bytes(b"\xff\xfe\x00 not json")
    with pytest.raises(DrafterArtifactError, match="invalid artifact config"):
        load_drafter(tmp_path / "s", expected_fingerprint=target.fingerprint)


@pytest.mark.parametrize("name", ["/etc/hostname", "../outside.bin", "sub/model.safetensors", "..", ""])
def test_files_listed_outside_the_artifact_directory_are_refused(target, tmp_path, name):
    """config.json names the artifact's own files: a path that leads elsewhere is never read."""
    model = standalone_from_target(target.model, num_layers=1)
    cfg = StandaloneConfig.for_target(target.model.config, num_layers=1, vocab_size=V)
    save_drafter(model, cfg, target.fingerprint, tmp_path / "s", version="v1")
    (tmp_path / "outside.bin").write_bytes(b"x")
    meta = json.loads((tmp_path / "s" / CONFIG_FILE).read_text())
    meta["files"][name] = sha256_file(tmp_path / "outside.bin")
    (tmp_path / "s" / CONFIG_FILE).write_text(json.dumps(meta))
    with pytest.raises(DrafterArtifactError, match="not a file name"):
        load_drafter(tmp_path / "s", expected_fingerprint=target.fingerprint)


def test_a_drafter_over_another_vocabulary_than_its_targets_is_refused(target, tmp_path):
    """Consistent tensors and config, the right fingerprint, but cut from a target of 300 tokens:
    its drafts past the target's 256 would be cut off (and its sampled drafts refused) forever."""
    other = tiny_target(vocab_size=300, hidden_size=64, num_layers=4, dtype=torch.bfloat16)
    model = standalone_from_target(other.model, num_layers=1)
    cfg = StandaloneConfig.for_target(other.model.config, num_layers=1, vocab_size=300)
    save_drafter(model, cfg, target.fingerprint, tmp_path / "s", version="v1")
    with pytest.raises(DrafterArtifactError, match="vocabulary of 300.*256"):
        load_drafter(tmp_path / "s", expected_fingerprint=target.fingerprint)


@pytest.mark.parametrize("update", [{"num_attention_heads": 0}, {"head_dim": 0}, {"head_dim": 15},
                                    {"rms_norm_eps": -1e-5}, {"max_position_embeddings": 0},
                                    {"num_key_value_heads": 5}])
def test_a_config_no_model_can_be_built_from_is_refused(target, tmp_path, update):
    """A config no model can run (checked by the config's own fields, or whatever the model's
    constructor raises) is the artifact's refusal (the Swapper counts and reports those), not an
    error of another kind escaping to its caller, nor a drafter that loads and then fails."""
    model = standalone_from_target(target.model, num_layers=1)
    cfg = StandaloneConfig.for_target(target.model.config, num_layers=1, vocab_size=V)
    save_drafter(model, cfg, target.fingerprint, tmp_path / "s", version="v1")
    meta = json.loads((tmp_path / "s" / CONFIG_FILE).read_text())
    meta["config"].update(update)
    (tmp_path / "s" / CONFIG_FILE).write_text(json.dumps(meta))
    with pytest.raises(DrafterArtifactError, match="invalid standalone model config|no standalone "
                                                   "model can be built from its config"):
        load_drafter(tmp_path / "s", expected_fingerprint=target.fingerprint)
