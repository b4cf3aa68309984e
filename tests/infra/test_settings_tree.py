"""One settings tree (infra/settings.py): the endpoints are read once and every section gets them;
a section's explicit settings and the trainer's own variables still win; the CLI reads through it."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from infra.settings import SpecloopSettings


@pytest.fixture
def env(monkeypatch):
    for k in [k for k in os.environ if k.startswith("SPECLOOP_")]:
        monkeypatch.delenv(k)

    def set_(**values):
        for k, v in values.items():
            monkeypatch.setenv(k, v)

    return set_


def test_endpoints_read_once_reach_serving_and_trainer(env):
    env(SPECLOOP_KAFKA_BOOTSTRAP_SERVERS="b:1", SPECLOOP_KAFKA_TOPIC="t", SPECLOOP_REDIS_URL="redis://r:2/0",
        SPECLOOP_REDIS_NAMESPACE="ns", SPECLOOP_MLFLOW_TRACKING_URI="http://m:3", SPECLOOP_TENANT="acme")
    tree = SpecloopSettings.load()
    s, t = tree.serving, tree.trainer
    assert (s.kafka_bootstrap_servers, t.bootstrap_servers) == ("b:1", "b:1")
    assert (s.kafka_topic, t.topic) == ("t", "t")
    assert (s.redis_url, t.redis_url) == ("redis://r:2/0",) * 2
    assert (s.redis_namespace, t.redis_namespace) == ("ns", "ns")
    assert (s.mlflow_tracking_uri, t.tracking_uri) == ("http://m:3",) * 2
    assert (s.tenant, t.tenant) == ("acme", "acme")


def test_on_stack_points_every_section_at_the_running_stack(env):
    env(SPECLOOP_KAFKA_BOOTSTRAP_SERVERS="elsewhere:9092", SPECLOOP_PORT="9100")
    info = SimpleNamespace(bootstrap_servers="127.0.0.1:1111", redis_url="redis://127.0.0.1:2222/0",
                           mlflow_uri="http://127.0.0.1:3333")
    tree = SpecloopSettings.load(serving={"k": 6}).on_stack(info, kafka_topic="own", tenant="demo-x")
    assert tree.endpoints.kafka_bootstrap_servers == "127.0.0.1:1111"
    for bus, topic, redis, mlflow, tenant in (
            (tree.serving.kafka_bootstrap_servers, tree.serving.kafka_topic, tree.serving.redis_url,
             tree.serving.mlflow_tracking_uri, tree.serving.tenant),
            (tree.trainer.bootstrap_servers, tree.trainer.topic, tree.trainer.redis_url,
             tree.trainer.tracking_uri, tree.trainer.tenant)):
        assert (bus, topic, redis, mlflow, tenant) == ("127.0.0.1:1111", "own", "redis://127.0.0.1:2222/0",
                                                      "http://127.0.0.1:3333", "demo-x")
    assert tree.serving.k == 6 and tree.serving.port == 9100  # overrides and the environment kept


def test_explicit_section_settings_and_the_trainers_own_names_win(env):
    env(SPECLOOP_MLFLOW_TRACKING_URI="http://shared:5000", SPECLOOP_TRAINER_TRACKING_URI="sqlite:///own.db")
    tree = SpecloopSettings.load(serving={"mlflow_tracking_uri": "http://given:5000"})
    assert tree.endpoints.mlflow_tracking_uri == "http://shared:5000"
    assert tree.serving.mlflow_tracking_uri == "http://given:5000"
    assert tree.trainer.tracking_uri == "sqlite:///own.db"


def test_the_trainer_trains_what_serving_serves(env):
    tree = SpecloopSettings.load(serving={"drafter": "standalone"})
    assert tree.trainer.drafter == "standalone" and not tree.trainer.hybrid
    tree = SpecloopSettings.load(serving={"drafter": "hybrid"})
    assert tree.trainer.hybrid
    default = SpecloopSettings.load()
    assert default.trainer.serve_drafter is None  # nothing said: the trainer's own choice


def test_bad_values_are_refused_with_the_field_named(env):
    env(SPECLOOP_DEV_MODE="0")
    with pytest.raises(ValueError, match="SPECLOOP_ADMIN_TOKEN"):
        SpecloopSettings.load(serving={"admin_token": "change-me"})


def test_the_cli_reads_serving_and_trainer_settings_through_the_tree(env):
    import infra.cli  # noqa: F401  (registers the commands, and the tree as their settings)
    from infra import root
    from serving import cli as serving_cli
    from trainer import cli as trainer_cli

    assert serving_cli._loader is root.serving_settings
    assert trainer_cli._loader is root.trainer_settings
    env(SPECLOOP_REDIS_NAMESPACE="shared-ns")
    assert serving_cli._settings(port=9001).redis_namespace == "shared-ns"
    assert trainer_cli._settings().redis_namespace == "shared-ns"


BARE = {"DEV_MODE": "1", "MODEL": "x", "TOPIC": "x", "TENANT": "x", "GROUP_ID": "x",
        "REDIS_URL": "redis://x:1/0", "TRACKING_URI": "sqlite:///x.db", "BOOTSTRAP_SERVERS": "x:1",
        "REDIS_NAMESPACE": "x", "SERVE_DRAFTER": "eagle", "KAFKA_TOPIC": "x"}


def test_bare_environment_names_are_not_settings(env):
    """Only the documented SPECLOOP_* names are read: a container's own MODEL, TOPIC or DEV_MODE
    (set for something else) changes nothing, and in particular does not turn dev mode on."""
    from feedback.endpoints import Endpoints
    from serving.config import ServingSettings
    from trainer.config import TrainerSettings

    env(**BARE, SPECLOOP_ADMIN_TOKEN="change-me")
    with pytest.raises(ValueError, match="SPECLOOP_ADMIN_TOKEN"):
        ServingSettings()
    with pytest.raises(ValueError, match="SPECLOOP_ADMIN_TOKEN"):
        SpecloopSettings.load()
    assert Endpoints().model_fields_set == set()  # nothing read
    t = TrainerSettings()
    assert t.model_fields_set == set()
    assert not t.dev_mode and t.model is None and t.serve_drafter is None and t.topic == "specloop.traces"


def test_prefixed_names_and_keywords_still_set_them(env):
    from serving.config import ServingSettings
    from trainer.config import TrainerSettings

    env(**BARE, SPECLOOP_DEV_MODE="1", SPECLOOP_MODEL="m", SPECLOOP_KAFKA_TOPIC="t",
        SPECLOOP_DRAFTER="standalone", SPECLOOP_ADMIN_TOKEN="change-me")
    assert ServingSettings().dev_mode  # dev mode on: the default token is accepted
    t = TrainerSettings()
    assert (t.dev_mode, t.model, t.topic, t.serve_drafter) == (True, "m", "t", "standalone")
    tree = SpecloopSettings.load()
    assert tree.serving.dev_mode and tree.trainer.dev_mode and tree.trainer.model == "m"
    env(SPECLOOP_TRAINER_DEV_MODE="0", SPECLOOP_TRAINER_MODEL="own")  # the trainer's own names win
    t = TrainerSettings()
    assert (t.dev_mode, t.model) == (False, "own")
    kw = TrainerSettings(model="k", topic="kt", dev_mode=False, serve_drafter="eagle")  # by field name
    assert (kw.model, kw.topic, kw.dev_mode, kw.drafter) == ("k", "kt", False, "eagle")
    assert not ServingSettings(dev_mode=False, admin_token="a-real-token-9f2c").dev_mode
