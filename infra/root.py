"""The composition root: serving, the Swapper, the trainer and the local stack, built from one
settings tree (infra/settings.py).

serving/ and trainer/ each know how to build their own parts from their own section
(serving/builder.py, trainer/actor.py); only this module holds the whole tree, so only here do the
two sides get the same endpoints. ``specloop serve``, ``specloop generate`` and ``specloop train``
read their settings through ``load_settings`` (installed by infra/cli_commands.py), and the demo
and ``bench online`` build their loop with ``build_serving`` and ``trainer_loop_factory``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the tree imports serving's settings (and torch with them): only when used
    from infra.settings import SpecloopSettings


def load_settings(**sections) -> SpecloopSettings:
    """The tree from the environment, with per-section overrides (``serving={...}``, ...)."""
    from infra.settings import SpecloopSettings

    return SpecloopSettings.load(**sections)


def cli_settings(**sections) -> SpecloopSettings:
    """``load_settings`` for a command that reads the tree itself (suffix-seed, demo, ``bench
    online``): a bad ``SPECLOOP_*`` value is a usage error in one line, as ``specloop serve`` says
    it (feedback/pydantic_errors.py), before anything loads, not a traceback."""
    import typer

    from feedback.pydantic_errors import SETTINGS_ERRORS, first_settings_error

    try:
        return load_settings(**sections)
    except SETTINGS_ERRORS as exc:
        raise typer.BadParameter(first_settings_error(exc)) from exc


def serving_settings(overrides: dict):
    """What ``specloop serve`` / ``generate`` run with: the tree's serving section."""
    return load_settings(serving=overrides).serving


def trainer_settings(overrides: dict):
    """What ``specloop train`` runs with: the tree's trainer section."""
    return load_settings(trainer=overrides).trainer


@dataclass
class ServingParts:
    engine: object
    swapper: object | None
    ops_observer: object | None


def build_serving(tree: SpecloopSettings, *, target=None, drafter=None, registry=None, sink=None,
                  swapper: bool = True, replica_id: str = "local", on_drift=None,
                  ops_flush_s: float | None = None) -> ServingParts:
    """One serving replica in this process (not started): the engine of ``tree.serving`` (with an
    injected ``target``/``drafter``/``sink`` where given), its drift observer (``on_drift`` hears
    each drift), its MLflow ops observer, and, with ``swapper``, the Swapper that follows the tree's
    registry and control plane."""
    from serving.builder import (
        build_drift_observer,
        build_engine,
        build_ops_observer,
        build_swapper,
    )

    s = tree.serving
    engine = build_engine(s, target=target, registry=registry, sink=sink, drafter=drafter)
    drift = build_drift_observer(s, replica_id, registry=registry, also_on_drift=on_drift)
    engine.observers.append(drift)
    run_options = {"flush_s": ops_flush_s} if ops_flush_s is not None else {}
    fingerprint = engine.target.fingerprint if target is None else target.fingerprint
    ops = build_ops_observer(s, fingerprint, replica_id, drift, **run_options)
    if ops is not None:
        engine.observers.append(ops)
    swaps = build_swapper(s, engine, target=target, registry=registry, replica_id=replica_id) if swapper else None
    return ServingParts(engine, swaps, ops)


def trainer_loop_factory(tree: SpecloopSettings, student, fingerprint, export_config,
                         initial_champion: str | None = None):
    """A picklable ``() -> TrainerLoop`` for the trainer's Ray worker (trainer/actor.py):
    ``tree.trainer``'s loop around ``student``, exporting artifacts of ``export_config``.
    ``initial_champion``: the version serving starts with when it is ``student`` itself."""
    from trainer.actor import build_loop
    from trainer.export import artifact_exporter

    return functools.partial(build_loop, tree.trainer, student, fingerprint, None,
                             exporter=artifact_exporter(export_config), initial_champion=initial_champion)


def build_stack(tree: SpecloopSettings, run_dir=None):
    """The local stack (broker, Redis, MLflow) of ``tree.stack``, not started (``.up()``)."""
    from infra.stack import Stack

    return Stack(run_dir, tree.stack)
