"""Drafter kinds by name, for the artifact format: config class, kind name, empty model."""

from __future__ import annotations

from torch import nn

from feedback.drafters.from_target import SelfSpecAdapter, SelfSpecConfig
from feedback.drafters.models import EagleHead, EagleHeadConfig, StandaloneConfig, build_standalone

DrafterConfig = EagleHeadConfig | SelfSpecConfig | StandaloneConfig
KINDS = ("eagle", "standalone", "selfspec")


def kind_of(config: DrafterConfig) -> str:
    if isinstance(config, EagleHeadConfig):
        return "eagle"
    if isinstance(config, SelfSpecConfig):  # before StandaloneConfig: it is a subclass
        return "selfspec"
    if isinstance(config, StandaloneConfig):
        return "standalone"
    raise TypeError(f"not a drafter config: {type(config).__name__}")


def parse_config(kind: str, data: dict) -> DrafterConfig:
    if kind == "eagle":
        return EagleHeadConfig.model_validate(data)
    if kind == "standalone":
        return StandaloneConfig.model_validate(data)
    if kind == "selfspec":
        return SelfSpecConfig.model_validate(data)
    raise ValueError(f"unknown learned drafter kind {kind!r} ({' | '.join(KINDS)})")


def build_model(config: DrafterConfig) -> nn.Module:
    """A freshly initialised model of this config (weights to be loaded). For ``selfspec`` that is
    the adapter alone: join it to the target with ``drafters_from_target.assemble``."""
    if isinstance(config, EagleHeadConfig):
        return EagleHead(config).eval()
    if isinstance(config, SelfSpecConfig):
        return SelfSpecAdapter(config).eval()
    return build_standalone(config)
