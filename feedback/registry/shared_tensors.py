"""Tensors a drafter shares with its target: named in the artifact by digest, never stored.

A standalone drafter cut from the target (the demo's default learned drafter) keeps the target's
token embedding, and the lm_head tied to it, frozen: 113 of the 142 MB of a two-layer SmolLM2
artifact. Stored, those bytes cost every promotion an export and an upload on the trainer's core
and a download, a checksum and a load beside serving's decode steps, for a tensor the server
already holds. Instead the artifact lists such a tensor under ``DrafterMeta.from_target`` (name ->
``tensor_digest`` in the artifact's dtype), and the loader takes the target's tensor of that name,
checks its digest (a server on other weights under the same fingerprint refuses the artifact) and
shares it: no copy where the dtypes agree.

Which tensors qualify is decided where both the drafter and its target are at hand
(``shared_with_target``: frozen parameters equal to the target's tensor of the same name), and
re-checked at every save (``save_drafter`` stores a listed tensor whose digest no longer agrees).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's dtype, shape and bytes (row-major)."""
    t = t.detach().cpu().contiguous()
    h = hashlib.sha256(f"{str(t.dtype).removeprefix('torch.')}{tuple(t.shape)}".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def _equal_to_target(params, target_model: nn.Module):
    """(name, parameter, target tensor) for each of ``params`` ((name, parameter) pairs) that equals
    ``target_model``'s tensor of the same name, compared in the parameter's dtype and device."""
    theirs = target_model.state_dict()
    for name, p in params:
        t = theirs.get(name)
        if t is not None and t.shape == p.shape and torch.equal(t.to(device=p.device, dtype=p.dtype), p):
            yield name, p, t


def shared_with_target(model: nn.Module, target_model: nn.Module) -> dict[str, str]:
    """{name: digest} of ``model``'s frozen parameters that equal ``target_model``'s tensor of the
    same name (in the parameter's dtype): what its artifacts may leave to the target. Tied
    parameters appear once, under the first name (as ``save_drafter`` stores them)."""
    frozen = ((n, p) for n, p in model.named_parameters() if not p.requires_grad)  # tied ones once
    return {name: tensor_digest(p) for name, p, _ in _equal_to_target(frozen, target_model)}


def share(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Make each named parameter of ``model`` (and every name tied to it) ``tensors``' tensor
    itself, frozen: no copy of what the target holds."""
    aliases = list(model.named_parameters(remove_duplicate=False))
    for name, t in tensors.items():
        mine = model.get_parameter(name)
        shared = nn.Parameter(t.detach(), requires_grad=False)
        for alias, p in aliases:
            if p is mine:
                owner, _, leaf = alias.rpartition(".")
                setattr(model.get_submodule(owner), leaf, shared)


def equal_target_tensors(model: nn.Module, target_model: nn.Module) -> dict[str, torch.Tensor]:
    """The target's tensors equal (dtype, device, shape, values) to ``model``'s parameter of the same
    name: what a drafter cut from the target and never trained (serving's day 0) can hold by
    reference."""
    return {name: t for name, p, t in _equal_to_target(model.named_parameters(), target_model)
            if t.dtype == p.dtype and t.device == p.device}


class TargetTensors:
    """The target's tensors by name, with their digests remembered per dtype (the target's weights
    do not change while it serves, and a digest of its 113 MB embedding takes ~0.2 s)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self._tensors = tensors
        self._digests: dict[tuple[str, torch.dtype], str] = {}

    def get(self, name: str, dtype: torch.dtype) -> torch.Tensor | None:
        """The tensor ``name`` in ``dtype`` (the target's own where the dtypes agree), or None."""
        t = self._tensors.get(name)
        return None if t is None else t.detach().to(dtype)

    def digest(self, name: str, dtype: torch.dtype) -> str | None:
        key = (name, dtype)
        if key not in self._digests:
            t = self.get(name, dtype)
            if t is None:
                return None
            self._digests[key] = tensor_digest(t)
        return self._digests[key]


class CheckpointTensors(Mapping):
    """A Hugging Face checkpoint directory's tensors by name, read one at a time when asked (for a
    server that holds no copy of its target's weights in this process: SGLang's)."""

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            self._files = {n: self.dir / f for n, f in json.loads(index.read_text())["weight_map"].items()}
        else:
            from safetensors import safe_open

            self._files = {}
            for f in sorted(self.dir.glob("*.safetensors")):
                with safe_open(str(f), framework="pt") as st:
                    self._files.update({n: f for n in st.keys()})  # noqa: SIM118 (a safe_open, not a dict)

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self._files[name]), framework="pt") as st:
            return st.get_tensor(name)

    def __iter__(self):
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)
