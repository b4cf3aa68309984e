"""ServingSettings: the engine choice and what each engine accepts."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from serving.config import EngineChoice, ServingSettings

SGLANG = {"engine": "sglang", "drafter": "eagle", "drafter_dir": "/models/draft"}


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    for field in ServingSettings.model_fields:
        monkeypatch.delenv(f"SPECLOOP_{field.upper()}", raising=False)


def test_torch_is_the_default_engine():
    assert ServingSettings().engine == "torch"
    assert EngineChoice().engine == "torch"


def test_engine_and_sglang_settings_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("SPECLOOP_ENGINE", "sglang")
    monkeypatch.setenv("SPECLOOP_DRAFTER", "standalone")
    monkeypatch.setenv("SPECLOOP_DRAFTER_DIR", "/models/draft")
    monkeypatch.setenv("SPECLOOP_SGLANG_TP_SIZE", "2")
    monkeypatch.setenv("SPECLOOP_SGLANG_MEM_FRACTION_STATIC", "0.7")
    monkeypatch.setenv("SPECLOOP_SGLANG_SERVER_ARGS", '{"context_length": 8192}')
    monkeypatch.setenv("SPECLOOP_TRACE_SAMPLE_RATE", "0.25")
    s = ServingSettings()
    assert EngineChoice().engine == s.engine == "sglang"
    assert s.sglang_algorithm == "STANDALONE"
    assert (s.sglang_tp_size, s.sglang_mem_fraction_static) == (2, 0.7)
    assert s.sglang_server_args == {"context_length": 8192}
    assert s.trace_sample_rate == 0.25


def test_eagle_runs_as_eagle3():
    assert ServingSettings(**SGLANG).sglang_algorithm == "EAGLE3"


@pytest.mark.parametrize("change, message", [
    ({"drafter": "suffix"}, "drafter='suffix'"),
    ({"drafter": "hybrid"}, "drafter='hybrid'"),
    ({"drafter_dir": None}, "drafter_dir is required"),
    ({"k": 0}, "k must be >= 1"),
    ({"adaptive_k": True}, "adaptive_k is TorchEngine only"),
    ({"trace_features": True}, "trace_features is TorchEngine only"),
    ({"device": "cpu"}, "CUDA GPU"),
])
def test_sglang_refuses_what_it_cannot_run(change, message):
    with pytest.raises(ValidationError, match=message):
        ServingSettings(**{**SGLANG, **change})


def test_torch_settings_are_not_checked_against_sglang():
    s = ServingSettings(drafter="suffix", k=0, adaptive_k=True, device="cpu")
    assert s.engine == "torch"


def test_explicitly_set_tells_defaults_from_choices(monkeypatch):
    monkeypatch.setenv("SPECLOOP_DTYPE", "bfloat16")
    s = ServingSettings(**SGLANG, device="cuda:1")
    assert s.explicitly_set("dtype") and s.explicitly_set("device")
    assert not s.explicitly_set("max_batch_size")


def test_k_is_a_budget_of_8_for_torch_and_a_fixed_4_for_sglang_unless_set():
    assert ServingSettings(device="cpu").k == 8
    assert ServingSettings(device="cpu").adaptive_k
    assert ServingSettings(**SGLANG).k == 4
    assert ServingSettings(**SGLANG, k=6).k == 6
