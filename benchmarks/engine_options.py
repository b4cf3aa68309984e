"""Engine options the benchmarks that build their own engines take alike (bench spec, bench
engine), with serving's defaults: what they measure is what ``specloop serve`` runs."""

from __future__ import annotations

from typing import Any

import typer

from serving.config import ServingSettings


def served_bf16_activations() -> bool:
    """ServingSettings.bf16_activations's default (the environment aside)."""
    return bool(ServingSettings.model_fields["bf16_activations"].default)


BF16_ACTIVATIONS_ENV = "SPECLOOP_BF16_ACTIVATIONS"
"""The variable serving reads the setting from (ServingSettings, prefix SPECLOOP_)."""


def bf16_activations_option() -> Any:
    """``--bf16-activations/--exact-activations``: the target's every forward, baseline and
    speculative alike, on bf16 activations (EngineConfig.bf16_activations). Unset, the flag is
    what ``specloop serve`` would run: SPECLOOP_BF16_ACTIVATIONS where set, else serving's default."""
    return typer.Option(served_bf16_activations(), "--bf16-activations/--exact-activations",
                        envvar=BF16_ACTIVATIONS_ENV,
                        help="Every engine's target forward rounds its activations to bf16 and "
                        "multiplies on the CPU's bf16 dot product (AVX-512 BF16) or AMX tiles, "
                        "baseline and speculative alike, as serving does by default "
                        "(SPECLOOP_BF16_ACTIVATIONS); exact: fp32 activations.")
