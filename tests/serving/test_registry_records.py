"""RegistryRecords: a Swapper's MLflow writes, off the swapping thread (real sqlite MLflow)."""

import pytest

from feedback.drafters.standalone_lm import StandaloneConfig, standalone_from_target
from feedback.registry.artifact import save_drafter
from feedback.registry.drafter_registry import DrafterRegistry, model_name
from serving.registry_records import RegistryRecords
from serving.target import tiny_target

TENANT = "records"


@pytest.fixture
def registered(tmp_path):
    target = tiny_target(vocab_size=64, hidden_size=32, num_layers=2)
    model = standalone_from_target(target.model, num_layers=1)
    cfg = StandaloneConfig.for_target(target.model.config, num_layers=1, vocab_size=64)
    save_drafter(model, cfg, target.fingerprint, tmp_path / "a", version="a")
    registry = DrafterRegistry(f"sqlite:///{tmp_path}/mlflow.db")
    version = registry.register(TENANT, registry.log_candidate(target.fingerprint, tmp_path / "a")).version
    return registry, version


def _events(registry, version) -> dict[str, str]:
    tags = registry.client.get_model_version(model_name(TENANT), version).tags
    return {k: v for k, v in tags.items() if k.startswith("event.")}


def test_events_wait_for_the_flush_and_keep_their_own_times(registered):
    """Noted events are written at the flush, after writes queued before it, each under a key
    of its own even within one millisecond."""
    registry, version = registered
    results = []
    records = RegistryRecords(registry, TENANT, nice=0, on_result=lambda m, e: results.append((m, e)))
    try:
        records.note_event(version, "swapped in on r0 (bench)")
        records.note_event(version, "rolled back on r0: live 0.1 < floor 0.5")  # the same ms
        records.write("log_live_acceptance", version, 0.5, 10)
        assert records.flush(timeout=30) and results[0] == ("log_live_acceptance", None)
        assert sorted(_events(registry, version).values()) == [
            "rolled back on r0: live 0.1 < floor 0.5", "swapped in on r0 (bench)"]
        assert results[1:] == [("log_event", None), ("log_event", None)]
    finally:
        records.stop()


def test_a_failing_write_is_reported_not_raised(registered):
    registry, _ = registered
    results = []
    records = RegistryRecords(registry, TENANT, nice=0, on_result=lambda m, e: results.append((m, e)))
    try:
        records.write("log_event", "999", "about a version that does not exist")
        assert records.flush(timeout=30)
        assert results and results[0][0] == "log_event" and results[0][1] is not None
    finally:
        records.stop()
