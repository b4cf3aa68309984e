"""Where the trainer's student trains: ``SPECLOOP_TRAINER_DEVICE`` = auto | cpu | cuda.

The decision is made once, in the process that starts the trainer (``specloop train``, the demo's
driver), because a Ray actor that asks for no GPU is started with ``CUDA_VISIBLE_DEVICES`` empty
and would find none: a CUDA trainer asks Ray for one GPU (``ray_gpus``) and trains on the one Ray
gives it, as ``cuda``. Which host GPU that is comes from outside (compose's ``device_ids``,
``CUDA_VISIBLE_DEVICES``), so the setting names no index.

Traces, the replay and the gate's bookkeeping stay on the CPU (numpy); a student moves each batch
to its device and its results back (trainer/students.py).
"""

from __future__ import annotations

import torch

from trainer.config import DeviceSetting


def resolve_device(setting: DeviceSetting | str) -> torch.device:
    """``auto``: CUDA where this process sees a GPU, else the CPU. ``cuda`` without one is an error
    at start (not a trainer that silently runs on the CPU while its GPU idles)."""
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if setting == "cpu":
        return torch.device("cpu")
    if setting == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("SPECLOOP_TRAINER_DEVICE=cuda, but this process sees no CUDA GPU (torch "
                             f"{torch.__version__}, CUDA_VISIBLE_DEVICES and the driver decide): use cpu or auto")
        return torch.device("cuda")
    raise ValueError(f"trainer device must be auto, cpu or cuda, not {setting!r}")


def ray_gpus(device: torch.device) -> int:
    """GPUs the trainer's Ray actor asks for: one for a CUDA student, none otherwise."""
    return 1 if device.type == "cuda" else 0


def settle(settings):
    """``settings`` (TrainerSettings) with ``device`` decided here, in the process that starts the
    actor, and the GPUs the actor must ask Ray for. Inside an actor that asked for none, ``auto``
    would find none."""
    device = resolve_device(settings.device)
    return settings.model_copy(update={"device": device.type}), ray_gpus(device)
