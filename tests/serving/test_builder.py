"""Settings -> engine: both engines get the same observers, HTTP layer and Swapper.

The SGLang tests here check *our* wiring only (settings -> SGLangConfig -> SGLangEngine, observers,
swapper, the fail-fast check). sglang needs a CUDA GPU and is not installed in CI, so where the
wiring needs "sglang is installed" the source-contract check is monkeypatched to pass; nothing here
starts SGLang or imports it (the engine imports sglang in ``start()`` only), which the tests assert.
"""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
from prometheus_client import CollectorRegistry
from transformers import GenerationConfig, LlamaConfig

from serving.api.protocol import ChatMessage
from serving.builder import (
    EngineUnavailable,
    build_engine,
    build_swapper,
    require_engine,
    sglang_config,
)
from serving.config import ServingSettings
from serving.metrics import SpecMetrics
from serving.observers import TraceRecorder
from serving.sglang import contract
from serving.target import load_default_tokenizer

SGLANG_INSTALLED = importlib.util.find_spec("sglang") is not None


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    for field in ServingSettings.model_fields:
        monkeypatch.delenv(f"SPECLOOP_{field.upper()}", raising=False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A Hugging Face model directory as SGLang would get it: config, generation config and
    tokenizer (no weights: only SGLang reads those)."""
    path = tmp_path_factory.mktemp("models") / "target-llm"
    tok = load_default_tokenizer()
    tok.save_pretrained(path)
    LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=4096,
                eos_token_id=tok.eos_token_id).save_pretrained(path)
    GenerationConfig(eos_token_id=[tok.eos_token_id, 7]).save_pretrained(path)
    return path


@pytest.fixture
def sglang_passes_its_check(monkeypatch):
    """Stand-in for an installed, contract-conforming sglang (wiring tests only)."""
    from serving.sglang import source_check

    monkeypatch.setattr(source_check, "require_sglang", lambda *a, **k: None)


def sglang_settings(model_dir, tmp_path, **kw) -> ServingSettings:
    draft = tmp_path / "draft"
    draft.mkdir(exist_ok=True)
    base = {"engine": "sglang", "model": str(model_dir), "drafter": "eagle", "drafter_dir": draft}
    return ServingSettings(**{**base, **kw})


def test_sglang_settings_build_an_sglang_engine_with_the_shared_observers(
        model_dir, tmp_path, sglang_passes_its_check):
    from serving.sglang.engine import SGLangEngine

    settings = sglang_settings(model_dir, tmp_path, trace_sink="memory", k=3)
    engine = build_engine(settings, registry=CollectorRegistry())

    assert isinstance(engine, SGLangEngine)
    assert engine._engine is None and "sglang" not in sys.modules  # built, not launched
    assert [type(o) for o in engine.observers] == [SpecMetrics, TraceRecorder]
    recorder = engine.observers[1]
    assert recorder.fingerprint == engine.fingerprint
    assert engine.fingerprint.model_id == engine.model_name == "target-llm"
    assert engine.fingerprint.vocab_size == len(engine.tokenizer)
    assert engine.max_context == 4096
    assert engine.eos_ids == {engine.tokenizer.eos_token_id, 7}  # generation config included
    assert (engine.drafter.kind, engine.drafter.version) == ("eagle", "day0")

    kwargs = engine.config.sglang_kwargs()
    assert kwargs["model_path"] == str(model_dir)
    assert kwargs["speculative_algorithm"] == "EAGLE3"
    assert kwargs["speculative_draft_model_path"] == str(settings.drafter_dir)
    assert kwargs["speculative_num_steps"] == 3 and kwargs["speculative_num_draft_tokens"] == 4
    assert kwargs["tp_size"] == 1


def test_the_http_layer_and_swapper_are_the_shared_ones(model_dir, tmp_path,
                                                        sglang_passes_its_check):
    from serving.api.app import create_app
    from serving.live_acceptance import LiveAcceptance
    from serving.sglang.drafts import SGLangDraftLoader
    from serving.swap import Swapper

    registry = CollectorRegistry()
    settings = sglang_settings(model_dir, tmp_path, drafter="standalone",
                               redis_url="redis://127.0.0.1:1/0", served_model_name="chat")
    engine = build_engine(settings, registry=registry)
    app = create_app(engine, settings, registry=registry)  # builds the swapper, starts nothing

    swapper = app.state.swapper
    assert isinstance(swapper, Swapper) and swapper.engine is engine
    assert isinstance(swapper.loader, SGLangDraftLoader)
    assert isinstance(engine.observers[-1], LiveAcceptance)
    assert swapper.version == "day0"
    serving = app.state.openai_serving
    card = serving.models().data[0]
    assert (card.id, card.root, card.max_model_len) == ("chat", "target-llm", 4096)
    ids = serving.encode_chat([ChatMessage(role="user", content="Hi")])
    assert ids and max(ids) < engine.fingerprint.vocab_size
    assert build_swapper(settings.model_copy(update={"redis_url": None}), engine) is None


def test_server_args_follow_explicit_settings_only(model_dir, tmp_path):
    defaults = sglang_config(sglang_settings(model_dir, tmp_path))
    assert defaults.server_args == {"tp_size": 1}  # dtype, batch size and GPU: SGLang's choice
    assert (defaults.max_running, defaults.max_waiting) == (None, 64)  # admission: SGLang's size

    chosen = sglang_config(sglang_settings(
        model_dir, tmp_path, dtype="bfloat16", max_batch_size=64, device="cuda:1",
        sglang_tp_size=2, sglang_mem_fraction_static=0.8, sglang_eagle_topk=4,
        sglang_num_draft_tokens=8, trace_sample_rate=0.5, trace_top_k=8, sglang_self_test=False,
        sglang_server_args={"context_length": 2048, "tp_size": 4}))
    assert chosen.server_args == {"tp_size": 4, "mem_fraction_static": 0.8, "dtype": "bfloat16",
                                  "max_running_requests": 64, "base_gpu_id": 1,
                                  "context_length": 2048}
    assert (chosen.eagle_topk, chosen.num_draft_tokens) == (4, 8)
    assert chosen.max_running == 64  # the admission bound's running batch
    assert (chosen.trace_sample_rate, chosen.trace_top_k, chosen.self_test) == (0.5, 8, False)


def test_derived_server_args_are_contract_fields(model_dir, tmp_path):
    """Everything we derive goes through the contract (checked against the pinned wheel);
    only the sglang_server_args escape hatch is the operator's responsibility."""
    config = sglang_config(sglang_settings(
        model_dir, tmp_path, dtype="float16", max_batch_size=4, device="cuda:0",
        sglang_mem_fraction_static=0.5))
    fields = {s.name.split(".", 1)[1] for s in contract.SYMBOLS
              if s.module.startswith("sglang.srt.arg_groups.fields.")}
    assert set(config.sglang_kwargs()) <= fields


def test_the_environment_alone_describes_an_sglang_deployment(model_dir, tmp_path, monkeypatch,
                                                              sglang_passes_its_check):
    (tmp_path / "draft").mkdir()
    for name, value in {"ENGINE": "sglang", "MODEL": str(model_dir), "DRAFTER": "standalone",
                        "DRAFTER_DIR": str(tmp_path / "draft"), "K": "5", "DEVICE": "cuda:0",
                        "TRACE_SAMPLE_RATE": "0.5",
                        "SGLANG_SERVER_ARGS": json.dumps({"context_length": 1024})}.items():
        monkeypatch.setenv(f"SPECLOOP_{name}", value)
    engine = build_engine(ServingSettings(), registry=CollectorRegistry())
    kwargs = engine.config.sglang_kwargs()
    assert kwargs["speculative_algorithm"] == "STANDALONE" and kwargs["speculative_num_steps"] == 5
    assert kwargs["base_gpu_id"] == 0 and kwargs["context_length"] == 1024
    assert engine.config.trace_sample_rate == 0.5
    assert [type(o) for o in engine.observers] == [SpecMetrics]  # trace_sink=none


def test_a_target_cannot_be_injected_into_sglang(model_dir, tmp_path, ids_target,
                                                 sglang_passes_its_check):
    with pytest.raises(ValueError, match="TorchEngine"):
        build_engine(sglang_settings(model_dir, tmp_path), target=ids_target)


@pytest.mark.skipif(SGLANG_INSTALLED, reason="sglang is installed")
def test_missing_sglang_fails_first_and_names_the_extra(tmp_path):
    with pytest.raises(EngineUnavailable, match=r"pip install 'specloop\[sglang\]'"):
        require_engine("sglang")
    settings = ServingSettings(engine="sglang", model=str(tmp_path / "not-there"),
                               drafter="eagle", drafter_dir=tmp_path)
    with pytest.raises(EngineUnavailable, match=r"specloop\[sglang\]"):
        build_engine(settings)  # before resolving (or converting) any model
    require_engine("torch")  # nothing to check


def test_torch_engine_gets_the_same_observers(ids_target):
    from serving.engine.torch_engine import TorchEngine

    engine = build_engine(ServingSettings(trace_sink="memory", trace_top_k=7), target=ids_target,
                          registry=CollectorRegistry())
    assert isinstance(engine, TorchEngine)
    assert [type(o) for o in engine.observers] == [SpecMetrics, TraceRecorder]
    assert engine.observers[1].fingerprint == ids_target.fingerprint
    assert engine.config.trace_topk == 7


def test_the_swapper_carries_the_replica_name_heartbeats_and_ops_runs_carry(ids_target, caplog):
    """SPECLOOP_REPLICA_ID names the replica in its swap and rollback events too (they carried a
    random name of their own), and API keys that map to a tenant this server does not follow are
    named at start: that traffic is served and traced, never learned for."""
    from serving.api.app import create_app

    settings = ServingSettings(redis_url="redis://127.0.0.1:1/0", replica_id="serving-acme-1",
                               api_keys={"k-1": "default", "k-2": "acme"})
    engine = build_engine(settings, target=ids_target, registry=CollectorRegistry())
    with caplog.at_level("WARNING", logger="serving.api.app"):
        app = create_app(engine, settings, registry=CollectorRegistry())  # starts nothing
    assert app.state.swapper.config.replica_id == "serving-acme-1" == settings.replica_name()
    assert settings.tenants_not_followed() == ["acme"]
    assert "['acme']" in caplog.text and "SPECLOOP_TENANT" in caplog.text

    anonymous = ServingSettings(redis_url="redis://127.0.0.1:1/0", api_keys={"k-2": "acme"}, tenant="acme")
    assert anonymous.tenants_not_followed() == []
    swapper = build_swapper(anonymous, build_engine(anonymous, target=ids_target, registry=CollectorRegistry()))
    assert swapper.config.replica_id == anonymous.replica_name() != "serving-acme-1"
