"""StepGraphs: the target's decode and verify forwards replayed as CUDA graphs.

Why: on a GPU a step of this small target is host-bound. LlamaForward launches ~450 kernels for
30 layers; on an H100 a one-token step took 17-24 ms launched op by op and 3.0-3.2 ms replayed
(ARCHITECTURE.md, "CUDA graphs for the step"). A CUDA graph records the launches once and replays
them with one call, as gpt-fast and SGLang do.

A graph replays fixed shapes at fixed addresses, so the parts of a step that change are made
static, and a graph is captured per (rows B, width bucket, read bucket, the cache's buffers):

- widths are padded up to a power of two (1, 2, 4, ... ``max_tokens``): the padded inputs are
  written past the row's real ones, where the cache keeps nothing (RaggedKVCache: columns past
  ``lengths[b]`` are garbage the masks hide), and their logits are dropped;
- attention reads the first R columns of the cache's buffers, R the step's read length
  (``max(lengths) + q``) rounded up to a power of two of at least 256: the step's mask [B, 1, q, L]
  is copied into a [B, 1, q', R] buffer whose columns past L are False (keys that never count, as
  in the shorter read, up to the order of a float reduction);
- this step's keys and values land at the columns ``RaggedKVCache.write_columns`` names, copied
  into a static buffer (``_ColumnWriter`` does the write in the graph); ids, positions and mask are
  copied in before each replay, and the logits come back as a copy.

Graphs stay valid while the cache's buffers stay where they are: the engine's batch cache on a GPU
has fixed stores (``RaggedKVCache.fixed_capacity``), so that rows joining and leaving and the
context growing never move them, and ``precapture`` records the graphs a batch will replay before
any request runs (a capture costs ~90 ms, about 25 replayed steps, on an H100). A cache whose
buffers move (one without fixed stores) simply gets new graphs (the least recently used of
``max_graphs`` dropped). Prefills (``logits_to_keep`` > 0 or more than ``max_tokens`` per row),
forwards that return hidden states and anything off CUDA keep the eager forward, and a capture that
raises turns the graphs off instead of failing the batch. ``capture=False`` runs the same
static-shape forward eagerly: how the tests check, on a CPU, that it computes what the eager
forward does.
"""

from __future__ import annotations

import collections
import logging
import time

import torch

from serving.engine.batch_cache import RaggedKVCache
from serving.engine.forward_output import ForwardOutput

log = logging.getLogger(__name__)

MIN_READ = 256
"""The smallest read bucket (columns): the cache's own allocation granule."""


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class _ColumnWriter:
    """The cache as a captured forward sees it: ``update`` writes a layer's new keys/values at the
    static (row, column) buffers and returns the first ``read`` columns of the buffers."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor],
                 rows: torch.Tensor, cols: torch.Tensor, read: int):
        self.keys, self.values, self.rows, self.cols, self.read = keys, values, rows, cols, read

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        keys, values = self.keys[layer_idx], self.values[layer_idx]  # [B, H, C, D] each
        keys[self.rows, :, self.cols] = key_states.transpose(1, 2).to(keys.dtype)  # [B, q', H, D]
        values[self.rows, :, self.cols] = value_states.transpose(1, 2).to(values.dtype)
        return keys[:, :, : self.read], values[:, :, : self.read]  # [B, H, R, D] each


class _Graph:
    """One captured (or, with capture off, eagerly run) forward and its static buffers."""

    def __init__(self, cache: RaggedKVCache, width: int, read: int):
        b, dev = cache.batch_size, cache.device
        self.width = width
        self.ids = torch.zeros(b, width, dtype=torch.long, device=dev)  # [B, q']
        self.positions = torch.zeros(b, width, dtype=torch.long, device=dev)  # [B, q']
        self.mask = torch.zeros(b, 1, width, read, dtype=torch.bool, device=dev)  # [B, 1, q', R]
        self.cols = torch.zeros(b, width, dtype=torch.long, device=dev)  # [B, q']
        rows = torch.arange(b, device=dev)[:, None].expand(-1, width).contiguous()  # [B, q']
        self.writer = _ColumnWriter(list(cache.keys), list(cache.values), rows, self.cols, read)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None  # [B, q', V], written by each replay

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
             cols: torch.Tensor) -> None:
        """Copy one step's inputs ([B, q], mask [B, 1, q, L], L <= R) into the static buffers; the
        padded inputs q..q' repeat the last real one's position and mask, one column further on each."""
        q, read = input_ids.shape[1], mask.shape[-1]
        self.ids[:, :q].copy_(input_ids)
        self.positions[:, :q].copy_(positions)
        self.mask[:, :, :q, :read].copy_(mask)
        self.mask[:, :, :q, read:].fill_(False)
        self.cols[:, :q].copy_(cols)
        if q < self.width:
            pad = self.width - q
            self.positions[:, q:].copy_(positions[:, -1:].expand(-1, pad))
            self.mask[:, :, q:].copy_(self.mask[:, :, q - 1 : q].expand(-1, -1, pad, -1))
            steps = torch.arange(1, pad + 1, device=cols.device)  # [pad]
            self.cols[:, q:].copy_(cols[:, -1:] + steps)


class StepGraphs:
    def __init__(self, forward, max_tokens: int = 32, max_graphs: int = 256, capture: bool = True):
        """``forward``: a LlamaForward; ``max_tokens``: the widest verify (tokens per row) replayed;
        ``max_graphs``: graphs kept (least recently used dropped); ``capture``: False runs the
        static-shape forward eagerly (tests on a CPU)."""
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

    def shape(self, cache: RaggedKVCache, q: int, read: int) -> tuple[int, int]:
        """(width, read) buckets of a step of ``q`` tokens per row reading ``read`` columns:
        powers of two, as far as the cache's capacity holds the padded columns."""
        width = self._width(q)
        if max(cache.lengths) + width > cache.capacity:  # the padding would not fit: no padding
            width = q
        return width, min(cache.capacity, max(MIN_READ, _pow2(read)))

    def _width(self, q: int) -> int:
        """The width bucket a step of ``q`` tokens per row is padded to."""
        return min(_pow2(q), self.max_tokens)

    def __call__(self, cache: RaggedKVCache, input_ids: torch.Tensor, positions: torch.Tensor,
                 mask: torch.Tensor) -> ForwardOutput:
        """One prepared step (``cache.prepare`` made ``positions`` [B, q] and ``mask`` [B, 1, q, L])
        through the graph for its shapes and buffers; the logits [B, q, V] are a copy."""
        q = input_ids.shape[1]
        with torch.inference_mode():
            key = self._key(cache, *self.shape(cache, q, mask.shape[-1]))
            entry = self._graphs.get(key)
            fresh = entry is None
            if fresh:
                entry = _Graph(cache, key[1], key[2])
            else:
                self._graphs.move_to_end(key)
            # loaded before a capture too: its warm-up run writes this step's keys and values
            # where this step writes them (static zeros would write over column 0 of every row)
            entry.load(input_ids, positions, mask, cache.write_columns())
            if fresh:
                try:
                    self._record(entry, cache.device, key)
                except RuntimeError as e:  # e.g. an op that cannot be captured: op by op from now on
                    log.warning("CUDA graph capture failed (%s: %s); steps run without graphs", type(e).__name__, e)
                    self.failure = f"{type(e).__name__}: {e}"
                    self._graphs.clear()
                    return self.forward(input_ids, positions, mask, cache)
            if entry.graph is not None:
                entry.graph.replay()
            else:
                entry.logits = self._run(entry)
            return ForwardOutput(entry.logits[:, :q].clone())

    def precapture(self, cache: RaggedKVCache, rows: range, max_width: int,
                   contexts: tuple[int, ...] = (0, MIN_READ)) -> int:
        """Capture, before any request runs, the graphs a batch of ``rows`` rows will replay for
        widths up to ``max_width`` at each context of ``contexts`` (default: reads of the first two
        buckets), over the rows of ``cache``'s stores (which must be fixed and empty). Returns how
        many were made (with ``capture`` off: run eagerly and kept, as ``__call__`` keeps them)."""
        if cache.fixed_capacity is None or (self.capture and cache.device.type != "cuda"):
            return 0
        before = len(self._graphs)
        widths = sorted({self._width(w) for w in range(1, max_width + 1)})
        with torch.inference_mode():
            for b in rows:
                for n in contexts:
                    if n + widths[0] > cache.fixed_capacity:  # a context the cache never holds
                        continue
                    cache.hold_rows(b, n)
                    try:
                        for w in (w for w in widths if n + w <= cache.fixed_capacity):
                            positions, mask = cache.prepare(w)
                            ids = torch.zeros(b, w, dtype=torch.long, device=cache.device)
                            self(cache, ids, positions, mask)
                    finally:
                        cache.clear()
                    if self.failure is not None:
                        return 0
        return len(self._graphs) - before

    @staticmethod
    def _key(cache: RaggedKVCache, width: int, read: int) -> tuple:
        buffers = tuple(t.data_ptr() for t in (*cache.keys, *cache.values))
        return cache.batch_size, width, read, buffers

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

    def _record(self, entry: _Graph, device: torch.device, key: tuple) -> None:
        """Capture ``entry``'s forward (with ``capture`` on) and keep it under ``key``."""
        if self.capture:
            t0 = time.perf_counter()
            entry.graph, entry.logits = self._captured(entry, device)
            self.captures += 1
            self.capture_s += time.perf_counter() - t0
            log.debug("captured a step graph for B=%d q=%d R=%d", *key[:3])
        self._graphs[key] = entry
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
