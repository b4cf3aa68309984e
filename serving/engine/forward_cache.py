"""One LlamaForward per model and process, and learned drafters' forwards that read its panels.

Two engines on one target in a process (a benchmark's target-only baseline beside its speculative
engine, the demo's baseline and then its loop, a test's reference engine) read the same packed
weights instead of a 538 MB copy each. That matters beyond memory: on this VM the memory speed
differs from one allocation to the next (ARCHITECTURE.md), and two copies made two engines' plain
steps differ by ~10 %, the size of what an A/B between them measures. A forward is rebuilt when a
weight of its model was replaced or modified in place since (a forward holds no other state).
"""

from __future__ import annotations

import threading
import weakref

import torch

from serving.engine.llama_forward import LlamaForward, tensor_version

_SHARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""model -> {(native, bf16_panels, amx, round_activations): (weights stamp, LlamaForward)}."""
_SHARED_LOCK = threading.Lock()


def _weights_stamp(model: torch.nn.Module) -> tuple:
    """Changes when any parameter or buffer of ``model`` is replaced or modified in place (in
    place: except for tensors made under ``torch.inference_mode``, which keep no version)."""
    return tuple((t.data_ptr(), tensor_version(t)) for t in (*model.parameters(), *model.buffers()))


def shared_forward(model: torch.nn.Module, native: bool | None = None, bf16_panels: bool = True,
                   amx: bool = True, round_activations: bool = False) -> LlamaForward:
    """The LlamaForward of ``model`` with these options, built once per process (and weights).
    ``round_activations``: the panels read with bf16 activations. A forward with the other
    activations, where one is built, lends its panels: one copy of the weights either way (and an
    A/B between the two arithmetics reads the same memory)."""
    stamp = _weights_stamp(model)
    with _SHARED_LOCK:
        per_model = _SHARED.setdefault(model, {})
        key = (native, bf16_panels, amx, round_activations)
        hit = per_model.get(key)
        if hit is not None and hit[0] == stamp:
            return hit[1]
        other = per_model.get((native, bf16_panels, amx, not round_activations))
        reuse = other[1] if other is not None and other[0] == stamp else None
        forward = LlamaForward(model, native=native, bf16_panels=bf16_panels, amx=amx, reuse=reuse,
                               round_activations=round_activations)
        per_model[key] = (stamp, forward)
        return forward


def existing_forward(model: torch.nn.Module) -> LlamaForward | None:
    """A forward ``shared_forward`` already built for ``model`` with its current weights, if any
    (never builds one: packing a whole target is half a gigabyte)."""
    stamp = _weights_stamp(model)
    with _SHARED_LOCK:
        for built_stamp, forward in _SHARED.get(model, {}).values():
            if built_stamp == stamp:
                return forward
    return None


def drafter_forward(model: torch.nn.Module, head_rows: torch.Tensor | None = None,
                    target: torch.nn.Module | None = None, bf16: bool = True,
                    int8: bool = False) -> LlamaForward:
    """A learned drafter's forward (a Llama LM of a few layers, e.g. the target's first layers and
    an adapter): every projection packed (``bf16``: the bf16 roundings of weights that are not
    exactly bf16), the lm_head at ``head_rows``, and the layers it shares with ``target`` read
    from the target's own packed panels where the engine has built them. ``int8``: every
    projection and the head as int8 panels instead (``PackedLinear.pack_int8``, half the bytes a
    draft token streams; shared layers get their own int8 copies)."""
    reuse = existing_forward(target) if target is not None and not int8 else None
    return LlamaForward(model, reuse=reuse, round_to_bf16=bf16, round_activations=bf16,
                        head_rows=head_rows, int8_panels=int8)
