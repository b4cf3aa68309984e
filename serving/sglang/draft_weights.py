"""Draft-only weight updates on a running sglang Engine, and the start-up check that they work.

SGLang 0.5.23 updates weights inside a session: ``begin_weight_update(selector)`` -> one or more
tensor updates -> ``end_weight_update()``. Only the request object carries the ``selector``, so we
build ``UpdateWeightsFromTensorReqInput(selector="draft")`` ourselves and send it through the
tokenizer manager (``Engine.update_weights_from_tensor`` has no selector argument). Never
``update_weights_from_disk`` for the draft: it loads every runner, the target included.
``flush_cache=False``: the target's KV cache stays valid; draft KV of cached prefixes was computed
by the previous draft, which costs some acceptance, never correctness (the target verifies).

The failure this guards against is the silent one: a draft that stays stale, or a "draft" update
that lands in the target. ``verify_draft_only_update`` checks both through weight checksums and a
target-only logprob before the engine serves.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

NamedTensors = list[tuple[str, torch.Tensor]]


class DraftUpdateError(RuntimeError):
    pass


def read_draft_tensors(path: str | Path) -> NamedTensors:
    """Every tensor of a draft directory's safetensors files, names as the checkpoint has them."""
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise DraftUpdateError(f"no .safetensors files in draft directory {path}")
    return [item for f in files for item in sorted(load_file(str(f)).items())]


async def update_draft_weights(engine, named_tensors: NamedTensors) -> None:
    """One draft-only update session on an ``sglang.Engine``; raises on any refused step."""
    from sglang.srt.managers.io_struct import (
        BeginWeightUpdateReqInput,
        EndWeightUpdateReqInput,
        UpdateWeightsFromTensorReqInput,
    )
    from sglang.srt.utils.common import MultiprocessingSerializer

    tm = engine.tokenizer_manager
    _ensure(await tm.begin_weight_update(BeginWeightUpdateReqInput(selector="draft"), None),
            "begin_weight_update(selector='draft')")
    try:
        payload = MultiprocessingSerializer.serialize(named_tensors)
        request = UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=[payload] * engine.server_args.tp_size,  # one per TP rank
            flush_cache=False,
            selector="draft",
        )
        _ensure(await tm.update_weights_from_tensor(request, None),
                "update_weights_from_tensor(selector='draft')")
    finally:
        _ensure(await tm.end_weight_update(EndWeightUpdateReqInput(), None), "end_weight_update")


async def weights_checksum(engine, selector: str) -> str:
    from sglang.srt.managers.io_struct import CheckWeightsReqInput

    success, message, _ranks, checksum = await engine.tokenizer_manager.check_weights(
        CheckWeightsReqInput(action="checksum", selector=selector), None)
    if not success or checksum is None:
        raise DraftUpdateError(f"check_weights(selector={selector!r}) failed: {message}")
    return checksum


async def target_logprob(engine, prompt_ids: list[int]) -> float:
    """Log-probability of the greedy first token: computed by the target's prefill alone."""
    out = await engine.async_generate(
        input_ids=prompt_ids, sampling_params={"max_new_tokens": 1, "temperature": 0.0},
        return_logprob=True)
    return float(out["meta_info"]["output_token_logprobs"][0][0])


def probe_tensor(named_tensors: NamedTensors) -> tuple[str, torch.Tensor]:
    """A floating-point draft tensor to perturb. Embeddings are skipped: SGLang may share them
    with the target on purpose, and the check is about weights that must be the draft's own."""
    for name, tensor in named_tensors:
        if tensor.is_floating_point() and tensor.numel() > 0 and "embed" not in name:
            return name, tensor
    raise DraftUpdateError("the draft has no floating-point tensor to probe")


async def verify_draft_only_update(engine, draft_path: str | Path, prompt_ids: list[int]) -> None:
    """Perturb one draft tensor, check that the draft changed and the target did not, restore."""
    name, original = probe_tensor(read_draft_tensors(draft_path))
    perturbed = original.clone()
    perturbed.view(-1)[0] += 1.0
    before = {s: await weights_checksum(engine, s) for s in ("draft", "target")}
    logprob_before = await target_logprob(engine, prompt_ids)

    await update_draft_weights(engine, [(name, perturbed)])
    try:
        during = {s: await weights_checksum(engine, s) for s in ("draft", "target")}
        logprob_during = await target_logprob(engine, prompt_ids)
    finally:
        await update_draft_weights(engine, [(name, original)])
    restored = await weights_checksum(engine, "draft")

    problems = []
    if during["draft"] == before["draft"]:
        problems.append(f"updating draft tensor {name!r} did not change the draft (stale drafter)")
    if during["target"] != before["target"]:
        problems.append(f"updating draft tensor {name!r} changed the target's weights")
    if not math.isclose(logprob_during, logprob_before, abs_tol=1e-3):
        problems.append(f"a draft update moved a target logprob ({logprob_before:.5f} -> "
                        f"{logprob_during:.5f})")
    if restored != before["draft"]:
        problems.append("restoring the draft tensor did not restore the draft's checksum")
    if problems:
        raise DraftUpdateError("draft-only weight update self-test failed: " + "; ".join(problems))


def _ensure(result, what: str) -> None:
    success, message = result[0], result[1]
    if not success:
        raise DraftUpdateError(f"{what} refused: {message}")
