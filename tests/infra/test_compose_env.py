"""What docker-compose.yml gives the serving and trainer containers is what their settings read
(issue 14): the shared endpoints land in both processes under the same names, and no SPECLOOP_*
variable is given to a process that would ignore it."""

from __future__ import annotations

import pytest
import yaml
from pydantic import AliasChoices
from test_compose import COMPOSE_FILE, interpolate

from feedback import endpoints
from serving.config import ServingSettings
from trainer.config import TrainerSettings


def _env_of(service: str) -> dict[str, str]:
    compose = yaml.safe_load(interpolate(COMPOSE_FILE.read_text()))
    return {k: str(v) for k, v in compose["services"][service]["environment"].items()}


def _read_names(settings_cls) -> set[str]:
    """Every environment variable a pydantic-settings class reads."""
    prefix = settings_cls.model_config.get("env_prefix", "")
    by_name = settings_cls.model_config.get("validate_by_name", False)
    names = set()
    for name, field in settings_cls.model_fields.items():
        alias = field.validation_alias
        if isinstance(alias, AliasChoices):
            names |= {c.upper() for c in alias.choices if isinstance(c, str)}
        elif isinstance(alias, str):
            names.add(alias.upper())
        if alias is None or by_name:
            names.add(f"{prefix}{name}".upper())
    return names


def _load(monkeypatch, env: dict[str, str], cls):
    for k in [k for k in __import__("os").environ if k.startswith("SPECLOOP_")]:
        monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return cls()


def test_trainer_reads_the_endpoints_compose_gives_it(monkeypatch):
    env = _env_of("trainer")
    s = _load(monkeypatch, env, TrainerSettings)
    assert s.bootstrap_servers == env[endpoints.KAFKA_BOOTSTRAP_SERVERS] == "kafka:9092"
    assert s.topic == env[endpoints.KAFKA_TOPIC]
    assert s.group_id == env[endpoints.KAFKA_GROUP]
    assert s.redis_url == env[endpoints.REDIS_URL]
    assert s.tracking_uri == env[endpoints.MLFLOW_TRACKING_URI] == "http://mlflow:5000"
    assert s.model == env[endpoints.MODEL]  # `specloop train` needs no --model in compose
    assert s.serve_drafter == env[endpoints.DRAFTER] and s.drafter == "standalone" and not s.hybrid


def test_a_trainer_drafter_of_its_own_that_serving_would_refuse_is_an_error(monkeypatch):
    """SPECLOOP_TRAINER_DRAFTER overrides for the trainer alone, but a kind serving does not serve
    (every replica would refuse its promotions) is refused at start, not silently replaced."""
    env = _env_of("trainer")  # serving serves standalone
    with pytest.raises(ValueError, match="SPECLOOP_TRAINER_DRAFTER.*SPECLOOP_DRAFTER=standalone"):
        _load(monkeypatch, {**env, "SPECLOOP_TRAINER_DRAFTER": "selfspec"}, TrainerSettings)
    assert _load(monkeypatch, {**env, "SPECLOOP_TRAINER_DRAFTER": "standalone"}, TrainerSettings).drafter == "standalone"
    hybrid = {**env, endpoints.DRAFTER: "hybrid", "SPECLOOP_TRAINER_DRAFTER": "selfspec"}
    s = _load(monkeypatch, hybrid, TrainerSettings)  # inside a hybrid any learned kind serves
    assert s.drafter == "selfspec" and s.hybrid
    with pytest.raises(ValueError, match="SPECLOOP_TRAINER_HYBRID"):
        _load(monkeypatch, {**hybrid, "SPECLOOP_TRAINER_HYBRID": "false"}, TrainerSettings)


def test_serving_and_the_trainer_gate_use_the_same_k(monkeypatch):
    serving_env = {**_env_of("serving"), "SPECLOOP_ADMIN_TOKEN": "an-operator-chosen-token"}
    serving = _load(monkeypatch, serving_env, ServingSettings)
    trainer = _load(monkeypatch, _env_of("trainer"), TrainerSettings)
    assert serving.k == trainer.k == 4
    # one SPECLOOP_K on the host sets both
    compose = COMPOSE_FILE.read_text()
    assert compose.count("${SPECLOOP_K:-4}") == 2 and "SPECLOOP_TRAINER_K: ${SPECLOOP_K:-4}" in compose


def test_trainer_checkpoints_land_on_its_scratch_volume(monkeypatch):
    compose = yaml.safe_load(interpolate(COMPOSE_FILE.read_text()))
    mounts = dict(v.split(":")[:2][::-1] for v in compose["services"]["trainer"]["volumes"])
    trainer = _load(monkeypatch, _env_of("trainer"), TrainerSettings)
    assert mounts["/scratch"] == "trainer-scratch"
    assert trainer.checkpoint_dir == "/scratch/trainer-ckpt"


def test_the_trainer_trains_on_the_gpu_compose_reserves_it(monkeypatch):
    """GPU 1 was reserved for a trainer that trained on the container's cores: the trainer now
    follows SPECLOOP_TRAINER_DEVICE, and compose asks for cuda where it reserves the GPU."""
    compose = yaml.safe_load(interpolate(COMPOSE_FILE.read_text()))
    reserved = compose["services"]["trainer"]["deploy"]["resources"]["reservations"]["devices"]
    assert [d["capabilities"] for d in reserved] == [["gpu"]] and len(reserved[0]["device_ids"]) == 1
    assert _load(monkeypatch, _env_of("trainer"), TrainerSettings).device == "cuda"


def test_compose_default_drafter_is_one_sglang_serves_and_the_trainer_learns_without_features(monkeypatch):
    """SGLang serving records no hidden states (trace_features is TorchEngine only), so the kind
    both sides default to must be one the trainer distils from tokens and top-k alone: not eagle."""
    serving_env = {**_env_of("serving"), "SPECLOOP_ADMIN_TOKEN": "an-operator-chosen-token"}
    serving = _load(monkeypatch, serving_env, ServingSettings)
    trainer = _load(monkeypatch, _env_of("trainer"), TrainerSettings)
    assert serving.engine == "sglang" and not serving.trace_features
    assert serving.drafter == trainer.drafter == "standalone"
    assert serving.sglang_algorithm == "STANDALONE"


@pytest.mark.parametrize(("given", "keys"), [("", {}), ('{"sk-live-4f9a7c": "acme"}', {"sk-live-4f9a7c": "acme"})])
def test_api_keys_reach_serving_and_empty_means_none(monkeypatch, given, keys):
    env = {**_env_of("serving"), "SPECLOOP_ADMIN_TOKEN": "an-operator-chosen-token"}
    assert env["SPECLOOP_API_KEYS"] == ""  # compose's default
    serving = _load(monkeypatch, {**env, "SPECLOOP_API_KEYS": given}, ServingSettings)
    assert serving.api_keys == keys


def test_serving_and_trainer_meet_on_the_same_endpoints(monkeypatch):
    serving_env = {**_env_of("serving"), "SPECLOOP_ADMIN_TOKEN": "an-operator-chosen-token"}
    serving = _load(monkeypatch, serving_env, ServingSettings)
    trainer = _load(monkeypatch, _env_of("trainer"), TrainerSettings)
    assert serving.kafka_bootstrap_servers == trainer.bootstrap_servers
    assert serving.kafka_topic == trainer.topic
    assert serving.redis_url == trainer.redis_url
    assert serving.mlflow_tracking_uri == trainer.tracking_uri
    assert serving.model == trainer.model
    assert serving.tenant == trainer.tenant


def test_compose_default_admin_token_is_refused(monkeypatch):
    """The published default (`change-me`) only works with SPECLOOP_DEV_MODE=1."""
    env = _env_of("serving")
    assert env["SPECLOOP_ADMIN_TOKEN"] == "change-me" and env["SPECLOOP_DEV_MODE"] == "0"
    with pytest.raises(ValueError, match="SPECLOOP_ADMIN_TOKEN"):
        _load(monkeypatch, env, ServingSettings)


@pytest.mark.parametrize(("service", "cls"), [("serving", ServingSettings), ("trainer", TrainerSettings)])
def test_every_specloop_variable_given_is_read(service, cls):
    given = {k for k in _env_of(service) if k.startswith("SPECLOOP_")}
    unread = given - _read_names(cls)
    assert not unread, f"{service} is given {sorted(unread)} but its settings do not read them"


def test_the_shared_names_are_read_by_the_trainer():
    assert set(endpoints.SHARED) <= _read_names(TrainerSettings)
