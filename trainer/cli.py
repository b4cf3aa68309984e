"""``specloop train``: run the trainer actor until interrupted (settings from SPECLOOP_TRAINER_*)."""

from __future__ import annotations

import functools

import typer


def make_student(model: str, kind: str, max_len: int):
    """Build the day-0 student from the target directory. Runs inside the Ray worker, so no model
    weights travel through the object store (on a cluster the path must exist on the worker)."""
    from transformers import AutoModelForCausalLM

    from feedback.drafter_models import eagle_from_target, standalone_from_target
    from trainer.eagle_student import EagleStudent
    from trainer.students import StandaloneStudent

    target = AutoModelForCausalLM.from_pretrained(model)
    if kind == "eagle":
        return EagleStudent(eagle_from_target(target), max_len=max_len)
    return StandaloneStudent(standalone_from_target(target).float(), max_len)


def train(
    model: str = typer.Option(..., help="Target model directory (HF format) the drafter is trained for."),
    rounds: int = typer.Option(0, help="Stop after this many rounds (0 = run until interrupted)."),
) -> None:
    """Consume traces, distil the drafter, gate, register and announce promotions."""
    import json

    from transformers import AutoConfig, AutoTokenizer

    from feedback.drafter_models import StandaloneConfig
    from feedback.fingerprint import TargetFingerprint, tokenizer_hash
    from trainer.actor import start_actor
    from trainer.config import TrainerSettings
    from trainer.export import artifact_exporter

    settings = TrainerSettings()
    tok = AutoTokenizer.from_pretrained(model)
    config = AutoConfig.from_pretrained(model)
    fp = TargetFingerprint(model_id=str(config.name_or_path or model).rstrip("/").split("/")[-1],
                           tokenizer_hash=tokenizer_hash(tok), vocab_size=int(config.vocab_size))
    export_cfg = StandaloneConfig.for_target(config) if settings.drafter == "standalone" else None
    factory = functools.partial(make_student, model, settings.drafter, settings.max_len)
    actor = start_actor(settings, factory, fp, exporter=artifact_exporter(export_cfg))
    import ray

    try:
        print(json.dumps(ray.get(actor.run.remote(rounds or None))))
    except KeyboardInterrupt:
        ray.get(actor.stop.remote())
    finally:
        ray.shutdown()
