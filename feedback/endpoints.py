"""The shared endpoints, named once: every process reads the bus, the control plane, the registry
and the target model from the same environment variables.

docker-compose.yml gives each container these names (``x-specloop-common``). ``Endpoints`` reads
them; infra's settings tree (infra/settings.py) hands the same values to serving's and the
trainer's settings, so a process started from the tree cannot disagree with its peers. A process
may also have its own, more specific name for a setting (``SPECLOOP_TRAINER_TRACKING_URI``);
``shared()`` accepts that first, then the shared name. Only these prefixed names are environment
variables: a bare ``MODEL`` or ``DEV_MODE`` in a container's environment is not read. Keyword
construction by field name (``TrainerSettings(model=...)``, what infra's tree does) comes from the
settings class's ``validate_by_name``, not from an alias: pydantic-settings reads every alias as an
environment variable name.
"""

from __future__ import annotations

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

KAFKA_BOOTSTRAP_SERVERS = "SPECLOOP_KAFKA_BOOTSTRAP_SERVERS"
KAFKA_TOPIC = "SPECLOOP_KAFKA_TOPIC"
KAFKA_GROUP = "SPECLOOP_KAFKA_GROUP"
REDIS_URL = "SPECLOOP_REDIS_URL"
REDIS_NAMESPACE = "SPECLOOP_REDIS_NAMESPACE"
MLFLOW_TRACKING_URI = "SPECLOOP_MLFLOW_TRACKING_URI"
MODEL = "SPECLOOP_MODEL"
DRAFTER = "SPECLOOP_DRAFTER"
DEV_MODE = "SPECLOOP_DEV_MODE"
TENANT = "SPECLOOP_TENANT"
DRAFTER_DIR = "SPECLOOP_DRAFTER_DIR"
"""The day-0 drafter serving starts with (serving's ``drafter_dir``); the trainer's first champion."""

SHARED = (KAFKA_BOOTSTRAP_SERVERS, KAFKA_TOPIC, KAFKA_GROUP, REDIS_URL, REDIS_NAMESPACE,
          MLFLOW_TRACKING_URI, MODEL, DRAFTER, DEV_MODE, TENANT, DRAFTER_DIR)

DEFAULT_KAFKA_BOOTSTRAP_SERVERS = "127.0.0.1:9092"
DEFAULT_KAFKA_TOPIC = "specloop.traces"
DEFAULT_REDIS_NAMESPACE = "specloop"


def shared(field: str, env: str, own_prefix: str | None = None) -> AliasChoices:
    """Validation aliases for ``field``: ``<own_prefix><FIELD>`` (if given), then the shared
    ``env`` name. Not ``field`` itself: an alias is also an environment variable name (case
    insensitive), so a bare ``MODEL``/``TOPIC`` would be read; a class using these sets
    ``validate_by_name=True`` so that ``field=...`` keywords still work."""
    names = [f"{own_prefix}{field.upper()}"] if own_prefix else []
    return AliasChoices(*names, env)


class Endpoints(BaseSettings):
    """Where every process meets: the trace bus, the control plane, the registry, the target and
    the tenant, read from the shared names above."""

    model_config = SettingsConfigDict(env_prefix="SPECLOOP_", extra="ignore")

    kafka_bootstrap_servers: str = Field(DEFAULT_KAFKA_BOOTSTRAP_SERVERS, description="Kafka bootstrap servers.")
    kafka_topic: str = Field(DEFAULT_KAFKA_TOPIC, description="The trace topic.")
    redis_url: str | None = Field(None, description="Redis control plane; None = none.")
    redis_namespace: str = Field(DEFAULT_REDIS_NAMESPACE, description="Control-plane key prefix, so "
                                 "deployments (or demo runs) can share one Redis.")
    mlflow_tracking_uri: str | None = Field(None, description="MLflow tracking + registry URI.")
    model: str | None = Field(None, description="Target model; None = the default SmolLM2.")
    tenant: str = Field("default", description="Tenant whose drafter is trained and served.")
    dev_mode: bool = Field(False, description="Local dev mode: published default secrets allowed.")
