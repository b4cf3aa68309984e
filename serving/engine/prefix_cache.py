"""PrefixCache: the target's keys and values of prompt prefixes the engine has prefilled, reused by
later prompts that start the same way: a chat template's system prompt (SmolLM2's is 22 tokens of
a ~60-token MT-Bench request), a conversation's earlier turns, a shared few-shot preamble.

Prompts are cut in blocks of ``block`` tokens; a block is keyed by the whole prompt up to its end
(so a block is reused only after the same prefix), as vLLM's automatic prefix caching and SGLang's
radix cache share the KV of common prefixes. A prompt reuses its longest run of cached blocks from
the start and prefills the rest (``ModelRunner.prefill``). The engine's forward computes a
token's keys and values, and its attention output, independently of how many tokens share the call
(kernels/packed_linear.py, kernels/native/decode_attention.c), so a prefill that starts from
cached blocks leaves bit for bit the cache and outputs of a full one. (The Hugging Face forward and
CUDA's GEMMs promise no such thing: there a cached prefix equals a computed one up to rounding, as
in vLLM and SGLang.)

Bounded by ``max_tokens`` (blocks evicted least recently used first; a hit refreshes a prefix's
blocks from its last to its first, so a prefix's first blocks outlive its later ones). One step
thread reads and writes it.
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class PrefixCache:
    def __init__(self, block: int = 8, max_tokens: int = 2048):
        if block < 1 or max_tokens < block:
            raise ValueError(f"prefix cache of {max_tokens} tokens in blocks of {block}")
        self.block = block
        self.max_blocks = max_tokens // block
        self._blocks: OrderedDict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        """prefix through a block's end -> that block's (keys, values), each [layers, H, block, D]."""
        self.hit_tokens = 0
        """Prompt tokens served from the cache instead of prefilled, since it was made."""
        self.prefilled_tokens = 0
        """Prompt tokens prefilled (the rest)."""

    def __len__(self) -> int:
        return len(self._blocks)

    def lookup(self, tokens: list[int]) -> tuple[int, list[torch.Tensor], list[torch.Tensor]]:
        """(n, keys, values): the first ``n`` tokens' cached keys and values per layer, [H, n, D]
        each (n a multiple of ``block``; 0 and empty lists on a miss)."""
        found = []
        for end in range(self.block, len(tokens) + 1, self.block):
            key = tuple(tokens[:end])
            kv = self._blocks.get(key)
            if kv is None:
                break
            found.append((key, kv))
        for key, _ in reversed(found):
            self._blocks.move_to_end(key)
        if not found:
            return 0, [], []
        keys = torch.cat([kv[0] for _, kv in found], dim=2)  # [layers, H, n, D]
        values = torch.cat([kv[1] for _, kv in found], dim=2)
        return len(found) * self.block, list(keys.unbind(0)), list(values.unbind(0))

    def insert(self, tokens: list[int], keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Keep the full blocks of ``tokens`` whose keys and values per layer, [H, >= len(tokens), D]
        (e.g. a batch-1 cache's row), are given; blocks already cached stay as they are."""
        ends = range(self.block, len(tokens) + 1, self.block)
        prefixes = [tuple(tokens[:end]) for end in ends]
        for end, key in zip(ends, prefixes):
            if key not in self._blocks:
                cols = slice(end - self.block, end)
                # stack copies: the block outlives the cache it came from. [layers, H, block, D]
                self._blocks[key] = (torch.stack([k[:, cols] for k in keys]),
                                     torch.stack([v[:, cols] for v in values]))
        for key in reversed(prefixes):  # the first blocks last: they are the most recently used
            self._blocks.move_to_end(key)
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)
