"""One settings tree for every process specloop starts.

    SpecloopSettings
      endpoints  feedback.endpoints.Endpoints   bus, control plane, registry, target, tenant
      serving    serving.config.ServingSettings  SPECLOOP_*          (specloop serve / generate)
      trainer    trainer.config.TrainerSettings  SPECLOOP_TRAINER_*  (specloop train)
      stack      infra.stack.StackSettings       SPECLOOP_STACK_*    (specloop stack up, up)

Each section is a pydantic-settings model that reads its own environment variables, so
docker-compose.yml (which sets environment variables per container) and the CLI describe the same
tree. The endpoints are read once and handed down: every endpoint that is set (in the environment
or as an override) reaches the matching field of ``serving`` and ``trainer`` (``ENDPOINT_FIELDS``
maps the names), unless that section was given the field explicitly (a keyword here, or the
trainer's own ``SPECLOOP_TRAINER_<FIELD>``). An endpoint set nowhere leaves each section its own
default (the trainer's registry defaults to a local sqlite file; serving's to none).
``on_stack`` points a whole tree at a running local stack: what the demo, ``bench online`` and the
topology test do.

``specloop serve``, ``specloop train``, the demo and the benchmarks build their parts from this
tree through infra/root.py.
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel, ConfigDict, PrivateAttr

from feedback.endpoints import Endpoints
from infra.stack import StackSettings
from serving.config import ServingSettings
from trainer.config import TrainerSettings

ENDPOINT_FIELDS: dict[str, dict[str, str]] = {
    "serving": {"kafka_bootstrap_servers": "kafka_bootstrap_servers", "kafka_topic": "kafka_topic",
                "redis_url": "redis_url", "redis_namespace": "redis_namespace",
                "mlflow_tracking_uri": "mlflow_tracking_uri", "model": "model", "tenant": "tenant",
                "dev_mode": "dev_mode"},
    "trainer": {"kafka_bootstrap_servers": "bootstrap_servers", "kafka_topic": "topic",
                "redis_url": "redis_url", "redis_namespace": "redis_namespace",
                "mlflow_tracking_uri": "tracking_uri", "model": "model", "tenant": "tenant",
                "dev_mode": "dev_mode"},
}
"""Endpoint field -> the field of that name in each section."""

SECTIONS = {"serving": ServingSettings, "trainer": TrainerSettings}
OWN_ENV_PREFIX = {"trainer": "SPECLOOP_TRAINER_"}
"""A section whose own environment variable for a field beats the shared one."""


class SpecloopSettings(BaseModel):
    """The tree (see the module docstring). Build it with ``load``; it is immutable."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    endpoints: Endpoints
    serving: ServingSettings
    trainer: TrainerSettings
    stack: StackSettings

    _overrides: dict = PrivateAttr(default_factory=dict)

    @classmethod
    def load(cls, *, endpoints: dict | None = None, serving: dict | None = None,
             trainer: dict | None = None, stack: dict | None = None) -> SpecloopSettings:
        """Read the environment; each keyword dict overrides fields of its section."""
        given = {name: dict(d or {})
                 for name, d in (("endpoints", endpoints), ("serving", serving), ("trainer", trainer),
                                 ("stack", stack))}
        ep = Endpoints(**given["endpoints"])
        sections: dict[str, Any] = {}
        for name, cls_ in SECTIONS.items():
            values = dict(given[name])
            for endpoint_field, field in ENDPOINT_FIELDS[name].items():
                if endpoint_field not in ep.model_fields_set:
                    continue  # not given anywhere: the section's own default
                if field in values or _own_env_set(name, field):
                    continue
                values[field] = getattr(ep, endpoint_field)
            if name == "trainer" and not ({"serve_drafter", "drafter"} & values.keys()) \
                    and sections["serving"].explicitly_set("drafter"):
                values["serve_drafter"] = sections["serving"].drafter  # train what serving serves
            sections[name] = cls_(**values)
        tree = cls(endpoints=ep, stack=StackSettings(**given["stack"]), **sections)
        tree._overrides = given
        return tree

    def with_changes(self, *, endpoints: dict | None = None, serving: dict | None = None,
                     trainer: dict | None = None, stack: dict | None = None) -> SpecloopSettings:
        """A new tree with these overrides on top of the ones this tree was loaded with."""
        o = self._overrides
        return SpecloopSettings.load(endpoints={**o.get("endpoints", {}), **(endpoints or {})},
                                     serving={**o.get("serving", {}), **(serving or {})},
                                     trainer={**o.get("trainer", {}), **(trainer or {})},
                                     stack={**o.get("stack", {}), **(stack or {})})

    def on_stack(self, info, **endpoints) -> SpecloopSettings:
        """This tree pointed at a running local stack (infra.stack.StackInfo); ``endpoints``:
        further endpoint overrides (e.g. a topic, namespace and tenant of one's own)."""
        return self.with_changes(endpoints={
            "kafka_bootstrap_servers": info.bootstrap_servers, "redis_url": info.redis_url,
            "mlflow_tracking_uri": info.mlflow_uri, **endpoints})


def _own_env_set(section: str, field: str) -> bool:
    prefix = OWN_ENV_PREFIX.get(section)
    return bool(prefix) and f"{prefix}{field.upper()}" in os.environ
