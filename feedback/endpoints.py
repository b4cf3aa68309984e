"""The shared endpoints, named once: every process reads the bus, the control plane, the registry
and the target model from the same environment variables.

docker-compose.yml gives each container these names (``x-specloop-common``). A process may also
have its own, more specific name for a setting (``SPECLOOP_TRAINER_TRACKING_URI``); ``shared()``
accepts that first, then the shared name, then the field's own name (for keyword construction).
"""

from __future__ import annotations

from pydantic import AliasChoices

KAFKA_BOOTSTRAP_SERVERS = "SPECLOOP_KAFKA_BOOTSTRAP_SERVERS"
KAFKA_TOPIC = "SPECLOOP_KAFKA_TOPIC"
KAFKA_GROUP = "SPECLOOP_KAFKA_GROUP"
REDIS_URL = "SPECLOOP_REDIS_URL"
MLFLOW_TRACKING_URI = "SPECLOOP_MLFLOW_TRACKING_URI"
MODEL = "SPECLOOP_MODEL"
DRAFTER = "SPECLOOP_DRAFTER"
DEV_MODE = "SPECLOOP_DEV_MODE"
TENANT = "SPECLOOP_TENANT"

SHARED = (KAFKA_BOOTSTRAP_SERVERS, KAFKA_TOPIC, KAFKA_GROUP, REDIS_URL, MLFLOW_TRACKING_URI, MODEL,
          DRAFTER, DEV_MODE, TENANT)


def shared(field: str, env: str, own_prefix: str | None = None) -> AliasChoices:
    """Validation aliases for ``field``: ``<own_prefix><FIELD>`` (if given), the shared ``env``
    name, then ``field`` itself."""
    names = [f"{own_prefix}{field.upper()}"] if own_prefix else []
    return AliasChoices(*names, env, field)
