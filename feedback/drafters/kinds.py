"""Drafter kinds by name, for the artifact format: config class, kind name, empty model."""

from __future__ import annotations

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from feedback.drafters.eagle_head import EagleHead, EagleHeadConfig
from feedback.drafters.from_target import SelfSpecAdapter, SelfSpecConfig
from feedback.drafters.standalone_lm import StandaloneConfig, build_standalone

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


class _SkipParameterInit(TorchFunctionMode):
    """Makes the in-place random/constant fills that module constructors apply to their
    parameters no-ops (the parameters keep whatever memory they were allocated with). Buffers are
    computed as usual (rotary frequencies). A torch function mode is per thread, so a model built
    this way on the Swapper's thread leaves every other thread's initialisation alone (unlike
    patching ``torch.nn.init``, as ``transformers.initialization.no_init_weights`` does)."""

    _TENSOR_FILLS = frozenset(getattr(torch.Tensor, n) for n in ("normal_", "uniform_", "fill_", "zero_"))
    _INIT_MODULES = ("torch.nn.init", "transformers.initialization")  # the latter wraps the former

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensor = args[0] if args else kwargs.get("tensor")
        if isinstance(tensor, nn.Parameter) and (
            func in self._TENSOR_FILLS
            or (getattr(func, "__module__", "") in self._INIT_MODULES and func.__name__.endswith("_"))
        ):
            return tensor
        return func(*args, **kwargs)


def build_model(config: DrafterConfig) -> nn.Module:
    """An empty model of this config, its weights to be loaded: parameters are allocated but not
    initialised (for a SmolLM2 standalone drafter that random init was 70 % of a hot swap's
    artifact load, ~0.55 of 0.8 s). For ``selfspec`` that is the adapter alone: join it to the
    target with ``drafters_from_target.assemble``."""
    with _SkipParameterInit():
        if isinstance(config, EagleHeadConfig):
            return EagleHead(config).eval()
        if isinstance(config, SelfSpecConfig):
            return SelfSpecAdapter(config).eval()
        return build_standalone(config)
