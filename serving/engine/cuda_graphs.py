"""StepGraphs: the target's decode and verify forwards replayed as CUDA graphs.

Why: on a GPU a step of this small target is host-bound. LlamaForward launches ~450 kernels for
30 layers, and on an H200 a one-token step took 21 ms of Python and launches for 0.2 ms of memory
traffic (ARCHITECTURE.md, "The engine on a CUDA GPU"). A CUDA graph records those launches once
and replays them with one call, as gpt-fast and SGLang do.

A graph replays fixed shapes and fixed addresses, so one is captured per (batch rows B, tokens
per row q, kept logits, the cache's buffers), and the parts of a step that change shape are made
static:

- attention reads all C columns of the cache's buffers (its capacity) instead of the first
  ``max(lengths) + q``; the step's mask [B, 1, q, L] is copied into a [B, 1, q, C] buffer whose
  columns past L are False (those keys never count: exactly what the shorter read computed, up to
  the order of a float reduction);
- this step's keys and values land at the columns ``RaggedKVCache.write_columns`` names, copied
  into a static [B, q] buffer before each replay (``_ColumnWriter`` does the write in the graph);
- the input ids, positions and mask are copied into static buffers; the logits come back as a
  copy, so a reader may keep them past the next step.

The cache's buffers move when it grows (every 256 columns) or rows join a full store; a graph is
then simply not found under the new addresses and one is captured for them (a few tens of ms; the
oldest of ``max_graphs`` are dropped). Prefills (``logits_to_keep`` > 0 or more than
``max_tokens`` per row), forwards that return hidden states, and anything off CUDA keep the eager
forward. ``capture=False`` runs the same static-shape forward eagerly: how the tests check, on a
CPU, that it computes what the eager forward does.
"""

from __future__ import annotations

import collections
import logging
import time

import torch

from serving.engine.batch_cache import RaggedKVCache
from serving.engine.forward_output import ForwardOutput

log = logging.getLogger(__name__)


class _ColumnWriter:
    """The cache as a captured forward sees it: ``update`` writes a layer's new keys/values at the
    static (row, column) buffers and returns the whole [B, H, C, D] buffers."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor],
                 rows: torch.Tensor, cols: torch.Tensor):
        self.keys, self.values, self.rows, self.cols = keys, values, rows, cols

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        keys, values = self.keys[layer_idx], self.values[layer_idx]  # [B, H, C, D] each
        keys[self.rows, :, self.cols] = key_states.transpose(1, 2).to(keys.dtype)  # [B, q, H, D]
        values[self.rows, :, self.cols] = value_states.transpose(1, 2).to(values.dtype)
        return keys, values


class _Graph:
    """One captured (or, with capture off, eagerly run) forward and its static buffers."""

    def __init__(self, cache: RaggedKVCache, q: int):
        b, c, dev = cache.batch_size, cache.capacity, cache.device
        self.ids = torch.zeros(b, q, dtype=torch.long, device=dev)  # [B, q]
        self.positions = torch.zeros(b, q, dtype=torch.long, device=dev)  # [B, q]
        self.mask = torch.zeros(b, 1, q, c, dtype=torch.bool, device=dev)  # [B, 1, q, C]
        self.cols = torch.zeros(b, q, dtype=torch.long, device=dev)  # [B, q]
        rows = torch.arange(b, device=dev)[:, None].expand(-1, q).contiguous()  # [B, q]
        self.writer = _ColumnWriter(list(cache.keys), list(cache.values), rows, self.cols)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None  # [B, q', V], written by each replay

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
             cols: torch.Tensor) -> None:
        """Copy one step's inputs into the static buffers (mask [B, 1, q, L], L <= C)."""
        self.ids.copy_(input_ids)
        self.positions.copy_(positions)
        read = mask.shape[-1]
        self.mask[..., :read].copy_(mask)
        self.mask[..., read:].fill_(False)
        self.cols.copy_(cols)


class StepGraphs:
    def __init__(self, forward, max_tokens: int = 32, max_graphs: int = 64, capture: bool = True):
        """``forward``: a LlamaForward; ``max_tokens``: the widest verify (tokens per row) captured;
        ``max_graphs``: captured graphs kept (least recently used dropped); ``capture``: False runs
        the static-shape forward eagerly (tests on a CPU)."""
        self.forward = forward
        self.max_tokens = max_tokens
        self.max_graphs = max_graphs
        self.capture = capture
        self._graphs: collections.OrderedDict[tuple, _Graph] = collections.OrderedDict()
        self._pool = None
        self.failure: str | None = None
        """Why a capture failed (every step has been eager since), or None."""
        self.captures = 0
        self.capture_s = 0.0
        """Graphs captured so far and the seconds they took (``bench engine`` reports them)."""

    def applies(self, cache, q: int, logits_to_keep: int, hidden_layers: tuple[int, ...]) -> bool:
        """Whether this forward replays a graph: a decode or verify step (logits of every input,
        at most ``max_tokens`` per row, no hidden states) over a RaggedKVCache with rows, on CUDA
        unless ``capture`` is off, and no capture has failed."""
        return (
            self.failure is None
            and isinstance(cache, RaggedKVCache)
            and (cache.device.type == "cuda" or not self.capture)
            and 0 < q <= self.max_tokens
            and logits_to_keep == 0
            and not hidden_layers
            and cache.batch_size > 0
        )

    def __call__(self, cache: RaggedKVCache, input_ids: torch.Tensor, positions: torch.Tensor,
                 mask: torch.Tensor) -> ForwardOutput:
        """One prepared step (``cache.prepare`` made ``positions`` [B, q] and ``mask`` [B, 1, q, L])
        through the graph for its shapes and buffers; the logits [B, q, V] are a copy."""
        with torch.inference_mode():
            key = self._key(cache, input_ids.shape[1])
            entry = self._graphs.get(key)
            if entry is None:
                try:
                    entry = self._new(cache, input_ids, positions, mask, key)
                except RuntimeError as e:  # e.g. an op that cannot be captured: op by op from now on
                    log.warning("CUDA graph capture failed (%s: %s); steps run without graphs", type(e).__name__, e)
                    self.failure = f"{type(e).__name__}: {e}"
                    self._graphs.clear()
                    return self.forward(input_ids, positions, mask, cache)
            else:
                self._graphs.move_to_end(key)
                entry.load(input_ids, positions, mask, cache.write_columns())
            if entry.graph is not None:
                entry.graph.replay()
            else:
                entry.logits = self._run(entry)
            return ForwardOutput(entry.logits.clone())

    @staticmethod
    def _key(cache: RaggedKVCache, q: int) -> tuple:
        buffers = tuple(t.data_ptr() for t in (*cache.keys, *cache.values))
        return cache.batch_size, q, cache.capacity, buffers

    def _run(self, entry: _Graph) -> torch.Tensor:
        return self.forward(entry.ids, entry.positions, entry.mask, entry.writer).logits

    def _captured(self, entry: _Graph, device: torch.device) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()  # one memory pool for all the graphs
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # lazy initialisation (handles, tables) outside the capture
            self._run(entry)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            logits = self._run(entry)
        return graph, logits

    def _new(self, cache: RaggedKVCache, input_ids, positions, mask, key) -> _Graph:
        entry = _Graph(cache, input_ids.shape[1])
        entry.load(input_ids, positions, mask, cache.write_columns())
        if self.capture:
            t0 = time.perf_counter()
            entry.graph, entry.logits = self._captured(entry, cache.device)
            self.captures += 1
            self.capture_s += time.perf_counter() - t0
            log.debug("captured a step graph for B=%d q=%d C=%d", *key[:3])
        self._graphs[key] = entry
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
        return entry
