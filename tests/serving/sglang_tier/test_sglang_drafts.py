"""SGLangDraftLoader: trainer artifacts -> tensors under SGLang's names, validated before a swap.

The engine is a stand-in exposing what the loader reads (fingerprint, served drafter); no sglang.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from feedback.drafters.eagle_head import eagle_from_target
from feedback.drafters.standalone_lm import StandaloneConfig, build_standalone
from feedback.registry.artifact import DrafterArtifactError, save_drafter
from feedback.target.fingerprint import TargetFingerprint
from serving.sglang.drafts import SGLangDraft, SGLangDraftLoader, artifact_tensors
from serving.target import tiny_target


@pytest.fixture(scope="module")
def standalone_cfg(ids_target):
    return StandaloneConfig.for_target(ids_target.model.config, num_layers=1)


@pytest.fixture
def artifact(tmp_path, ids_target, standalone_cfg):
    torch.manual_seed(1)
    model = build_standalone(standalone_cfg)
    save_drafter(model, standalone_cfg, ids_target.fingerprint, tmp_path / "v7", version="v7")
    return tmp_path / "v7", model


def served(fingerprint, kind="standalone", tensors=None):
    day0 = SGLangDraft(kind, "day0", tensors=tensors)
    return SimpleNamespace(fingerprint=fingerprint, drafter=day0)


def test_a_standalone_artifact_becomes_sglang_tensors(artifact, ids_target, standalone_cfg):
    path, model = artifact
    day0 = artifact_tensors(build_standalone(standalone_cfg), "standalone")
    draft = SGLangDraftLoader(served(ids_target.fingerprint, tensors=day0)).load(path)
    assert (draft.kind, draft.version) == ("standalone", "v7")
    names = dict(draft.named_tensors())
    assert set(names) == set(model.state_dict())  # HF Llama names: SGLang's Llama loader's
    for name, t in model.state_dict().items():
        assert torch.equal(names[name], t)


def test_an_eagle_artifact_is_exported_under_eagle3_names(tmp_path):
    target = tiny_target(vocab_size=101, hidden_size=32, num_layers=4, seed=2)
    head = eagle_from_target(target.model, draft_vocab=torch.tensor([0, 5, 7, 50]), init="random")
    save_drafter(head, head.config, target.fingerprint, tmp_path / "e1", version="e1")
    draft = SGLangDraftLoader(served(target.fingerprint, kind="eagle")).load(tmp_path / "e1")
    names = dict(draft.named_tensors())
    assert {"fc.weight", "lm_head.weight", "d2t", "t2d"} <= set(names)
    assert names["d2t"].dtype == torch.int64 and names["t2d"].dtype == torch.bool
    assert "embed_tokens.weight" not in names  # SGLang shares the target's


def test_the_wrong_kind_target_or_shape_is_refused(artifact, ids_target, standalone_cfg):
    path, _ = artifact
    with pytest.raises(ValueError, match="SGLang serves a eagle draft"):
        SGLangDraftLoader(served(ids_target.fingerprint, kind="eagle")).load(path)
    other = TargetFingerprint(model_id="other", tokenizer_hash="x", vocab_size=101)
    with pytest.raises(DrafterArtifactError, match="refusing"):
        SGLangDraftLoader(served(other)).load(path)
    wider = standalone_cfg.model_copy(
        update={"intermediate_size": 2 * standalone_cfg.intermediate_size})
    current = artifact_tensors(build_standalone(wider), "standalone")
    with pytest.raises(ValueError, match="shapes differ"):
        SGLangDraftLoader(served(ids_target.fingerprint, tensors=current)).load(path)
    with pytest.raises(ValueError, match="no tensor name in common"):
        SGLangDraftLoader(served(ids_target.fingerprint,
                                 tensors=[("fc.weight", torch.zeros(1))])).load(path)


def test_the_draft_carries_its_artifacts_trace_times_for_the_swappers_freshness(
        tmp_path, ids_target, standalone_cfg):
    """As a TorchEngine drafter does (serving/drafters/factory.py): SGLang's swaps log freshness."""
    from serving.registry_records import trace_freshness

    model = build_standalone(standalone_cfg)
    times = {"trace_finished_median_at": 1000.0, "trace_finished_newest_at": 1040.0}
    save_drafter(model, standalone_cfg, ids_target.fingerprint, tmp_path / "v8", version="v8",
                 extra={**times, "window_traces": 12, "trace_finished_at_note": "n/a"})
    save_drafter(model, standalone_cfg, ids_target.fingerprint, tmp_path / "v9", version="v9")
    loader = SGLangDraftLoader(served(ids_target.fingerprint))
    draft = loader.load(tmp_path / "v8")
    assert draft.trace_times == times
    assert trace_freshness(draft, now=1100.0) == {"freshness_s": 100.0, "newest_trace_age_s": 60.0}
    untimed = loader.load(tmp_path / "v9")
    assert untimed.trace_times == {} and trace_freshness(untimed, now=1100.0) == {}
