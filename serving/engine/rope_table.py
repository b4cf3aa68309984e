"""RopeTable: a Llama model's rotary cos/sin looked up in a table its own rotary embedding made once.

Why: the module computes them per forward (an outer product of positions and frequencies, then
elementwise cos and sin: six to eight torch ops), 0.15-0.3 ms after a forward has flushed the CPU
caches, where a learned draft token costs ~2 ms and a target step ~14. Two index ops into a table
give the same bits (the table's rows are the same products and the same elementwise functions;
tests/serving/test_rope_table.py checks them against the module).
"""

from __future__ import annotations

import torch

STATIC_ROPE = ("default", "linear", "llama3")
"""Rotary types whose cos/sin at a position do not depend on the sequence length."""


class RopeTable:
    def __init__(self, rotary: torch.nn.Module, max_positions: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None):
        """``rotary``: the model's rotary embedding (HF's ``rotary_emb``: ``(x, position_ids) ->
        (cos, sin)``); the table covers positions below ``max_positions`` (0: no table). It is made
        here, for activations of ``dtype`` on ``device`` (3-9 ms for 8,192 positions on a 2-core
        CPU: at a forward's construction, off the step thread, not at its first call, which for a
        swapped-in drafter can be a step); activations of another dtype or device remake it."""
        self.rotary = rotary
        self.max_positions = max_positions
        self.tabled = getattr(rotary, "rope_type", None) in STATIC_ROPE and max_positions > 0
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None
        """cos, sin [max_positions, D] (one tuple: no torn reads)."""
        if self.tabled:
            self._table = self._make(dtype, device)

    def _make(self, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            x = torch.zeros(1, 1, 1, dtype=dtype, device=device)  # the module reads only its dtype/device
            positions = torch.arange(self.max_positions, device=device)[None]  # [1, P]
            cos, sin = self.rotary(x, positions)  # [1, P, D] each
        return cos[0], sin[0]

    def table(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """cos, sin [max_positions, D] as made at construction (for native code that looks rows
        up itself: kernels/draft_chain.py), or None where positions are not tabled."""
        return self._table if self.tabled else None

    def __call__(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, q, D] at ``position_ids`` [B, q] for activations ``x`` [B, q, H] (their
        dtype and device)."""
        if self.tabled:
            table = self._table
            if table is None or table[0].device != x.device or table[0].dtype != x.dtype:
                table = self._table = self._make(x.dtype, x.device)
            try:
                return table[0][position_ids], table[1][position_ids]  # [B, q, D] each
            except IndexError:  # a position past the model's maximum: the module extrapolates
                pass
        return self.rotary(x, position_ids)
