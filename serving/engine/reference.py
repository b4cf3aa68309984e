"""Plain target-only greedy decoding, the yardstick for losslessness (tests and benchmark), and
the Hugging Face forward computing as a forward on bf16 activations does (``rounded_arithmetic``)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

_BF16_ATTENTION = "specloop_bf16_reference"


def _round(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float()


def _bf16_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **_):
    """Attention as kernels/native/attention_tiles_bf16.h computes it (up to the order of fp32
    sums): queries and keys rounded to bf16 for the scores, fp32 softmax, its numerators and the
    values rounded to bf16 for the weighted sum, normalised after. query [B, Hq, q, D], key and
    value [B, Hkv, L, D], attention_mask [B, 1, q, L] additive or bool (True: seen); returns
    [B, q, Hq, D]."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = _round(query) @ _round(key).transpose(-1, -2) * scaling  # [B, Hq, q, L]
    if attention_mask is not None:
        mask = attention_mask[..., : key.shape[-2]]
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    e = torch.exp(scores - scores.amax(-1, keepdim=True))
    out = (_round(e) @ _round(value)) / e.sum(-1, keepdim=True)  # [B, Hq, q, D]
    return out.transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def rounded_arithmetic(model: torch.nn.Module, linear: bool = True, attention: bool = False):
    """While active, ``model``'s Hugging Face forward reads every Linear's input rounded to bf16
    (``linear``), and takes its attention on bf16 operands (``attention``): the reference of
    ``LlamaForward(round_activations=True)``, whose ``bf16_attention`` says whether it does the
    latter."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import eager_mask

    hooks = [m.register_forward_pre_hook(lambda _m, args: (_round(args[0]), *args[1:]))
             for m in model.modules() if linear and isinstance(m, torch.nn.Linear)]
    before = model.config._attn_implementation
    if attention:
        AttentionInterface.register(_BF16_ATTENTION, _bf16_attention)
        AttentionMaskInterface.register(_BF16_ATTENTION, eager_mask)
        model.set_attn_implementation(_BF16_ATTENTION)
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
        if attention:
            model.set_attn_implementation(before)


@torch.inference_mode()
def target_greedy_reference(
    model: torch.nn.Module,
    prompt_ids: list[int],
    max_new_tokens: int,
    stop_ids: set[int] | frozenset[int] = frozenset(),
) -> list[int]:
    """Batch 1, one token per forward, Hugging Face ``DynamicCache``; stops after a token in
    ``stop_ids`` (included) or after ``max_new_tokens``."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    cache = DynamicCache()
    inp = torch.tensor([prompt_ids], dtype=torch.long, device=device)  # [1, P]
    out: list[int] = []
    for _ in range(max_new_tokens):
        logits = model(input_ids=inp, past_key_values=cache, use_cache=True).logits  # [1, q, V]
        token = int(logits[0, -1].argmax())
        out.append(token)
        if token in stop_ids:
            break
        inp = torch.tensor([[token]], dtype=torch.long, device=device)
    return out


@dataclass
class GreedyCheck:
    """How far an output is from greedy under teacher forcing (see ``teacher_forced_check``)."""

    mismatches: list[int]
    """Output positions whose token is not the target's argmax given the output before it."""
    max_gap: float
    """Largest ``max logit - logit of the emitted token`` over the output (0.0 = all argmax)."""
    max_gap_ulps: float = 0.0
    """The same gap in bf16 ulps of the top logit (the resolution of a bf16 logit)."""

    def lossless(self, ulps: float = 0.0) -> bool:
        """True when every token is the argmax, or within ``ulps`` bf16 ulps of it. In bf16, a
        different computation order (verifying k+1 tokens at once instead of one, another batch
        shape) moves logits by about one ulp and can flip near-tied argmaxes with no logic error:
        judge bf16 greedy outputs with ``ulps`` of 1-2, fp32 ones with 0."""
        return self.max_gap_ulps <= ulps


@torch.inference_mode()
def teacher_forced_check(
    model: torch.nn.Module, prompt_ids: list[int], output_ids: list[int]
) -> GreedyCheck:
    """Score ``output_ids`` with one target forward over prompt + output: at each position, is the
    emitted token the target's argmax? Unlike comparing against ``target_greedy_reference``, one
    near-tie does not desynchronise the rest of the comparison."""
    if not output_ids:
        return GreedyCheck([], 0.0)
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt_ids) + list(output_ids[:-1])], device=device)  # [1, P+N-1]
    logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 :].float()  # [N, V]
    out = torch.tensor(output_ids, device=device)  # [N]
    top = logits.max(dim=-1).values  # [N]
    gap = top - logits.gather(1, out[:, None]).squeeze(1)  # [N]
    ulp = torch.exp2(torch.floor(torch.log2(top.abs().clamp(min=1e-30))) - 7)  # [N] bf16 spacing
    return GreedyCheck(
        mismatches=(gap > 0).nonzero().squeeze(1).tolist(),
        max_gap=float(gap.max()),
        max_gap_ulps=float((gap / ulp).max()),
    )
