import hashlib

import pytest
import torch
from safetensors.torch import save_file

from feedback.registry.drafter_registry import DrafterRegistry, RegistryError
from feedback.target.fingerprint import TargetFingerprint

FP = TargetFingerprint(model_id="reg-test", tokenizer_hash="ab" * 8, vocab_size=48)


def _digest(d):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir()) if p.is_file()}


@pytest.fixture
def registry(tmp_path):
    return DrafterRegistry(f"sqlite:///{tmp_path}/mlflow.db")


def test_registered_version_downloads_bit_identical_with_lineage(registry, tmp_path):
    src = tmp_path / "cand"
    src.mkdir()
    save_file({"w": torch.randn(4, 4)}, str(src / "model.safetensors"))
    (src / "config.json").write_text('{"kind": "standalone"}')
    rid = registry.log_candidate(FP, src, params={"topic": "specloop.traces", "offsets": "0:0-10"},
                                 metrics={"cand_expected_acceptance": 0.5},
                                 curves={"train_loss": [(0, 2.0), (1, 1.5)]})
    reg = registry.register("acme", rid)
    assert reg.version == "1" and registry.champion("acme").version == "1"
    path, _got = registry.download("acme")
    assert _digest(path) == _digest(src)
    run = registry.client.get_run(rid)
    assert run.data.params["offsets"] == "0:0-10"
    assert [m.value for m in registry.client.get_metric_history(rid, "train_loss")] == [2.0, 1.5]
    assert registry.client.get_experiment(run.info.experiment_id).name == f"specloop/{FP.key()}"
    registry.log_live_acceptance("acme", reg.version, 0.4, step=3, replica_id="r0")
    assert registry.client.get_metric_history(rid, "live_accept_len.r0")[0].value == 0.4
    # a second version moves the alias
    rid2 = registry.log_candidate(FP, src)
    assert registry.register("acme", rid2).version == "2"
    assert registry.champion("acme").version == "2"
    assert not any(p.suffix in (".pkl", ".pt") for p in path.rglob("*"))


def _candidate(registry, tmp_path):
    src = tmp_path / "cand"
    src.mkdir(exist_ok=True)
    save_file({"w": torch.zeros(2, 2)}, str(src / "model.safetensors"))
    return registry.log_candidate(FP, src)


def test_clearing_the_champion_leaves_the_tenant_without_one(registry, tmp_path):
    """A rollback to a drafter the registry does not hold (day 0) takes the alias off: the
    tenant then reads as having no champion, the versions stay; clearing twice, or for a tenant
    without a model, is no error."""
    registry.register("acme", _candidate(registry, tmp_path))
    registry.register("other", _candidate(registry, tmp_path))
    registry.clear_champion("acme")
    assert registry.champion("acme") is None
    assert registry.champion("other").version == "1"
    with pytest.raises(RegistryError, match="no 'champion'"):
        registry.download("acme")
    assert registry.download("acme", "1")[1].version == "1"
    registry.clear_champion("acme")
    registry.clear_champion("nobody")
    registry.set_champion("acme", "1")
    assert registry.champion("acme").version == "1"


def test_live_acceptance_is_a_curve_per_replica(registry, tmp_path):
    """Each replica logs its own key against its own step count: two replicas' points are never
    one curve whose steps jump back and forth."""
    rid = _candidate(registry, tmp_path)
    version = registry.register("acme", rid).version
    registry.log_live_acceptance("acme", version, 2.0, step=8, replica_id="replica-a")
    registry.log_live_acceptance("acme", version, 3.0, step=5, replica_id="replica-b")
    registry.log_live_acceptance("acme", version, 2.5, step=16, replica_id="replica-a")
    registry.log_live_acceptance("acme", version, 1.5, step=1, replica_id="host:4/x y")
    history = {k: sorted((m.step, m.value) for m in registry.client.get_metric_history(rid, k))
               for k in registry.client.get_run(rid).data.metrics}
    assert history == {"live_accept_len.replica-a": [(8, 2.0), (16, 2.5)],
                       "live_accept_len.replica-b": [(5, 3.0)],
                       "live_accept_len.host_4_x_y": [(1, 1.5)]}


def test_missing_champion_is_a_clear_error(registry):
    assert registry.champion("nobody") is None
    with pytest.raises(RegistryError, match="no 'champion'"):
        registry.download("nobody")


def test_load_champion_validates_through_the_artifact(registry, tmp_path):
    from feedback.drafters.standalone_lm import StandaloneConfig, build_standalone
    from feedback.registry.artifact import save_drafter

    cfg = StandaloneConfig(vocab_size=48, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=2, head_dim=8)
    model = build_standalone(cfg)
    save_drafter(model, cfg, FP, tmp_path / "art", version="c1")
    registry.register("t1", registry.log_candidate(FP, tmp_path / "art"))
    loaded, _meta = registry.load_champion("t1", FP)
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    other = TargetFingerprint(model_id="other", tokenizer_hash="cd" * 8, vocab_size=48)
    with pytest.raises(RegistryError, match="refused"):
        registry.load_champion("t1", other)


def test_an_unreachable_registry_is_not_a_missing_champion(monkeypatch):
    """An outage raises (the Swapper logs it and keeps polling) instead of reading as "this tenant
    has no champion", which would say nothing while the registry is down."""
    from mlflow.exceptions import MlflowException

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    with pytest.raises(MlflowException):
        DrafterRegistry("http://127.0.0.1:1").champion("acme")
