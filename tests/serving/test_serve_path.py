"""One serve path: what `specloop serve` installs at a promotion is what the trainer's gate judged
(the learned drafter inside the hybrid, keeping the running suffix index), the drafter kind is one
setting both sides read, and an artifact of another kind is refused with both kinds named."""

from __future__ import annotations

import pytest

from feedback.drafters.standalone_lm import StandaloneConfig, standalone_from_target
from feedback.registry.artifact import save_drafter
from serving.artifact_loader import DrafterKindMismatch
from serving.builder import build_draft_loader, build_engine
from serving.config import ServingSettings
from serving.drafters.hybrid import HybridDrafter
from serving.drafters.suffix import SuffixDrafter
from serving.target import tiny_target
from trainer.config import TrainerSettings


@pytest.fixture(scope="module")
def target():
    return tiny_target(vocab_size=97, hidden_size=64, num_layers=4, seed=0)


def _artifact(target, path):
    model = standalone_from_target(target.model, num_layers=2, init="target-layers", seed=1)
    cfg = StandaloneConfig.for_target(target.model.config, num_layers=2, vocab_size=97)
    save_drafter(model, cfg, target.fingerprint, path, version="7")
    return path


@pytest.mark.parametrize("kind", ["suffix", "hybrid"])
def test_default_serve_path_installs_the_hybrid_the_gate_judged(kind, target, tmp_path):
    settings = ServingSettings(drafter=kind)
    engine = build_engine(settings, target=target)
    day0 = engine.drafter
    suffix = day0 if kind == "suffix" else day0.suffix
    assert isinstance(suffix, SuffixDrafter)
    suffix.observe("default", [1, 2, 3, 4, 5])  # what the index learned before the promotion
    drafter = build_draft_loader(settings, engine).load(_artifact(target, tmp_path / "a"), day0)
    assert isinstance(drafter, HybridDrafter)  # not the learned drafter alone
    assert drafter.suffix is suffix  # the suffix index is kept, not dropped
    assert TrainerSettings(serve_drafter=kind).hybrid  # and the trainer gates it as a hybrid


def test_mismatched_artifact_kind_is_refused_naming_both(target, tmp_path):
    settings = ServingSettings(drafter="eagle")
    engine = build_engine(ServingSettings(drafter="suffix"), target=target)
    loader = build_draft_loader(settings, engine)
    with pytest.raises(DrafterKindMismatch, match="'standalone' drafter .* serves 'eagle'"):
        loader.load(_artifact(target, tmp_path / "a"), engine.drafter)


def test_the_trainer_follows_the_serving_drafter_setting(monkeypatch):
    monkeypatch.setenv("SPECLOOP_DRAFTER", "eagle")
    s = TrainerSettings()
    assert s.drafter == "eagle" and not s.hybrid  # compose: serving eagle -> trainer trains eagle
    monkeypatch.setenv("SPECLOOP_DRAFTER", "hybrid")
    s = TrainerSettings()
    assert s.drafter == "standalone" and s.hybrid
    monkeypatch.delenv("SPECLOOP_DRAFTER")
    assert TrainerSettings().serve_drafter is None
