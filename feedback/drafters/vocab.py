"""Draft vocabularies: the day-0 choice of target ids, the tokenizer's special ids that every
draft vocabulary keeps, and the validation of a given one."""

from __future__ import annotations

from collections.abc import Sequence

import torch

DEFAULT_DRAFT_VOCAB_SIZE = 16384


def checked_vocab_ids(ids, vocab_size: int) -> torch.Tensor:
    """A draft vocabulary as [Vd] int64 CPU target ids: non-empty, 1-D, integer, strictly
    increasing, inside [0, vocab_size). ValueError, saying which, otherwise."""
    ids = torch.as_tensor(ids)
    if ids.ndim != 1 or ids.numel() == 0 or ids.is_floating_point() or ids.dtype == torch.bool:
        raise ValueError(f"a draft vocabulary is a non-empty 1-D tensor of integer ids, got "
                         f"{ids.dtype} {tuple(ids.shape)}")
    ids = ids.to(torch.int64).cpu().contiguous()
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"draft vocabulary ids outside the target vocabulary [0, {vocab_size})")
    if not bool((ids[1:] > ids[:-1]).all()):
        raise ValueError("draft vocabulary ids must be sorted and distinct")
    return ids


def day0_draft_vocab(
    vocab_size: int,
    draft_vocab_size: int,
    special_ids: Sequence[int] = (),
    frequencies: torch.Tensor | Sequence[float] | None = None,
) -> torch.Tensor:
    """Sorted [Vd] target ids of a draft vocabulary.

    Without ``frequencies`` it is the lowest ids (BPE ids are roughly frequency-ordered); with a
    [V] frequency table (the trainer counts traffic) it is the most frequent ids, ties to the lower
    id. ``special_ids`` (EOS and other specials) are always included.
    """
    draft_vocab_size = min(draft_vocab_size, vocab_size)
    specials = sorted({int(i) for i in special_ids if i is not None and 0 <= int(i) < vocab_size})
    if len(specials) > draft_vocab_size:
        raise ValueError(
            f"{len(specials)} special tokens do not fit a {draft_vocab_size}-token draft vocab"
        )
    if frequencies is None:
        score = -torch.arange(vocab_size, dtype=torch.float64)  # lower id first
    else:
        score = torch.as_tensor(frequencies, dtype=torch.float64).clone()
        if score.shape != (vocab_size,):
            raise ValueError(
                f"frequencies must have shape ({vocab_size},), got {tuple(score.shape)}"
            )
    if specials:
        score[specials] = float("inf")
    # stable sort on -score keeps the lower id first among equal scores
    order = torch.sort(-score, stable=True).indices[:draft_vocab_size]  # [Vd]
    return torch.sort(order).values.to(torch.long)


def special_token_ids(tokenizer, config=None) -> list[int]:
    """EOS/BOS/PAD and every tokenizer special id (may be empty for ids-only test targets)."""
    ids: set[int] = set()
    if tokenizer is not None:
        ids.update(int(i) for i in getattr(tokenizer, "all_special_ids", []) or [])
    for src in (tokenizer, config):
        for name in ("eos_token_id", "bos_token_id", "pad_token_id"):
            v = getattr(src, name, None) if src is not None else None
            if isinstance(v, int):
                ids.add(v)
            elif isinstance(v, (list, tuple)):
                ids.update(int(i) for i in v)
    return sorted(ids)
