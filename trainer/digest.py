"""Content hashes of a student's weights: which exact weights a result belongs to.

``weights_digest`` hashes every tensor (the loop refuses a rolled-back version unchanged and skips a
refresh to the champion's own weights); ``trainable_digest`` only those training changes (held-out
results are remembered per weights, trainer/eval_cache.py: frozen target layers a selfspec drafter
shares never change and would make each lookup hash the target).
"""

from __future__ import annotations

import hashlib

import torch


def _digest(named_tensors, h) -> str:
    for name, t in named_tensors:
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def weights_digest(student) -> str:
    """sha256 over every tensor of the student's state dict, in name order."""
    return _digest(sorted(student.model.state_dict().items()), hashlib.sha256())


def trainable_digest(student) -> str:
    """blake2b over the parameters that train (all of the state for a student with none)."""
    params = student.trainable_state()
    return _digest((params or student.model.state_dict()).items(), hashlib.blake2b(digest_size=16))
