"""RaggedKVCache: one batched KV cache whose rows hold different numbers of tokens.

Layout: row b keeps its committed tokens contiguous at columns ``[0, lengths[b])`` of per-layer
buffers ``[B, H, C, D]`` (C = capacity). A forward of q new tokens per row writes them at columns
``[lengths[b], lengths[b] + q)`` of each row (an index_put), and attention reads columns
``[0, max(lengths) + q)`` under a 4D mask that lets query i of row b see columns
``j < lengths[b] + i + 1``. Position ids are the column indices, so RoPE sees each row's true
positions.

Speculative rollback is then free: after verification a row keeps its first ``accepted + 1`` new
columns by advancing ``lengths[b]``; the rejected columns past it are garbage that the mask hides
and the next step overwrites. No holes.

Token trees (``set_tree`` before ``prepare``): node i of row b still lands at column
``lengths[b] + i``, but its position is ``lengths[b] + depth(i)`` and it sees the committed prefix,
its ancestors and itself. ``commit_paths`` then moves the accepted path's columns to consecutive
columns (one gather/scatter per layer, only when some row's path is not already a prefix). A row
joins by a copy into a spare row of the buffers' stores (a prefilled batch-1 cache; ``append``) and
leaves by one surviving row moved into its hole (``drop_rows``): neither copies the batch.

The object implements the one method HF Llama attention calls on ``past_key_values``
(``update(keys, values, layer_idx)``); the engine always passes a prepared 4D mask and explicit
``position_ids``, so transformers never asks the cache for lengths or mask sizes.
"""

from __future__ import annotations

import torch

from kernels.kv_rows import move_rows

_GROW = 256  # capacity granularity (columns)


class RaggedKVCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        batch_size: int = 0,
    ):
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.capacity = 0
        shape = (batch_size, num_kv_heads, 0, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.values = [
            torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)
        ]
        self.lengths: list[int] = [0] * batch_size
        """Committed tokens per row (columns [0, lengths[b]) are valid)."""
        self._write_rows: torch.Tensor | None = None  # [B, q] row of each new column (pending step)
        self._write_cols: torch.Tensor | None = None  # [B, q] its column
        self._read_len = 0
        self._tree: tuple[torch.Tensor, torch.Tensor] | None = None  # (depth [B, q], anc [B, q, q])
        self.max_rows: int | None = None
        """Rows the owner will run at most (the engine's max batch size): the stores' row count."""
        self.fixed_capacity: int | None = None
        """Set (with ``max_rows``): the stores are allocated once, ``max_rows`` rows of this many
        columns, at the first need, and never move, grow or shrink; a forward past it is an error.
        CUDA graphs bake in the buffers' addresses (serving/engine/cuda_graphs.py)."""
        self._stores: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        """Per layer (keys, values) [R, H, C, D] with R >= B rows: ``keys[l]``/``values[l]`` are
        their first B rows while they last (``append``); a reallocation elsewhere ends that."""

    @classmethod
    def for_model(cls, model: torch.nn.Module, batch_size: int = 0,
                  dtype: torch.dtype | None = None) -> RaggedKVCache:
        """A cache for ``model``'s layers, of its parameters' dtype unless ``dtype`` is given."""
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        param = next(model.parameters())
        return cls(
            cfg.num_hidden_layers,
            cfg.num_key_value_heads,
            head_dim,
            dtype or param.dtype,
            param.device,
            batch_size,
        )

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    # ---- one forward -------------------------------------------------------------------------

    def prepare(self, q: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Get ready for a forward of ``q`` new tokens per row.

        Returns ``(position_ids [B, q] int64, mask [B, 1, q, max(lengths)+q] bool)`` to pass to the
        model. The new columns land at ``lengths[b] + i``; ``commit`` decides how many stay.
        """
        read_len = max(self.lengths, default=0) + q
        self._ensure_capacity(read_len)
        start = torch.tensor(self.lengths, dtype=torch.long, device=self.device)  # [B]
        columns = start[:, None] + torch.arange(q, device=self.device)  # [B, q]
        cols = torch.arange(read_len, device=self.device)  # [L]
        tree, self._tree = self._tree, None
        if tree is None:
            positions = columns
            mask = cols[None, None, :] <= positions[:, :, None]  # [B, q, L]
        else:
            depth, anc = tree  # [B, q], [B, q, q]
            if depth.shape != (self.batch_size, q):
                raise ValueError(f"tree for {tuple(depth.shape)} nodes, forward of {q}")
            positions = start[:, None] + depth  # [B, q]
            mask = (cols[None, :] < start[:, None])[:, None, :].expand(-1, q, -1).clone()  # [B, q, L]
            b_idx = torch.arange(self.batch_size, device=self.device)[:, None, None].expand(-1, q, q)
            i_idx = torch.arange(q, device=self.device)[None, :, None].expand(self.batch_size, -1, q)
            mask[b_idx, i_idx, columns[:, None, :].expand(-1, q, -1)] = anc
        self._write_rows = torch.arange(len(self.lengths), device=self.device)[:, None].expand(
            -1, q
        )
        self._write_cols = columns  # [B, q]
        self._read_len = read_len
        return positions, mask[:, None]  # [B, q], [B, 1, q, L]

    def seed(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Fill an empty batch-1 cache with committed tokens whose keys and values per layer,
        [H, n, D] each, are given (a cached prompt prefix: serving/engine/prefix_cache.py)."""
        if self.batch_size != 1 or self.lengths[0] != 0:
            raise ValueError("seed fills an empty batch-1 cache")
        n = keys[0].shape[1]
        self._ensure_capacity(n)
        for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
            self.keys[layer][0, :, :n] = k
            self.values[layer][0, :, :n] = v
        self.lengths = [n]

    def set_tree(self, depth: torch.Tensor, ancestors: torch.Tensor) -> None:
        """The next ``prepare(q)`` lays out a token tree per row: ``depth`` [B, q] of each node
        (root 0), ``ancestors`` [B, q, q] bool (node i sees node j iff j is i or an ancestor)."""
        self._tree = (depth.to(self.device), ancestors.to(self.device))

    def write_columns(self) -> torch.Tensor:
        """[B, q]: the column each new token of the prepared forward lands at. For a fused
        attention kernel that writes ``keys``/``values`` itself instead of calling ``update``."""
        if self._write_cols is None:
            raise RuntimeError("RaggedKVCache.prepare() must be called before a forward")
        return self._write_cols

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ):
        """Called by each attention layer: write this step's keys/values, return the readable span."""
        rows, cols = self._write_rows, self._write_cols
        if rows is None:
            raise RuntimeError("RaggedKVCache.prepare() must be called before a forward")
        # Advanced indices around a slice put their dims first: the target is [B, q, H, D].
        # (index_put is ~10-30x faster than scatter_ here.)
        self.keys[layer_idx][rows, :, cols] = key_states.transpose(1, 2).to(self.dtype)
        self.values[layer_idx][rows, :, cols] = value_states.transpose(1, 2).to(self.dtype)
        n = self._read_len
        return self.keys[layer_idx][:, :, :n], self.values[layer_idx][:, :, :n]

    def commit(self, kept: list[int]) -> None:
        """After a forward: row b keeps its first ``kept[b]`` new columns."""
        if len(kept) != self.batch_size:
            raise ValueError(f"commit: {len(kept)} rows for a batch of {self.batch_size}")
        self.lengths = [n + int(k) for n, k in zip(self.lengths, kept)]
        self._write_rows = self._write_cols = None

    def commit_paths(self, paths: list[list[int]]) -> None:
        """After a tree forward: row b keeps the new columns of nodes ``paths[b]`` (root first, in
        path order), moved to consecutive columns ``lengths[b], lengths[b] + 1, ...``."""
        if len(paths) != self.batch_size:
            raise ValueError(f"commit_paths: {len(paths)} rows for a batch of {self.batch_size}")
        rows, src, dst = [], [], []
        for b, (n, path) in enumerate(zip(self.lengths, paths)):
            for j, node in enumerate(path):
                if node != j:
                    rows.append(b)
                    src.append(n + int(node))
                    dst.append(n + j)
        if rows:
            # Flat row indices into each [B, H, C, D] buffer seen as [B*H*C, D], every layer's
            # keys and values moved in one call (kernels/kv_rows.py: all read, then all written).
            h, cap = self.num_kv_heads, self.capacity
            s = [(b * h + i) * cap + c for b, c in zip(rows, src) for i in range(h)]
            d = [(b * h + i) * cap + c for b, c in zip(rows, dst) for i in range(h)]
            for buffers in (self.keys, self.values):
                for layer, buf in enumerate(buffers):
                    if not buf.is_contiguous():
                        buffers[layer] = buf.contiguous()
            move_rows(self.keys + self.values, torch.tensor(s), torch.tensor(d))
        self.commit([len(p) for p in paths])

    # ---- batch membership --------------------------------------------------------------------

    def append(self, other: RaggedKVCache) -> None:
        """Add ``other``'s rows (e.g. a freshly prefilled batch-1 cache) at the end of the batch.

        The buffers are the first rows of stores with spare rows (``_stores``; up to ``max_rows``,
        the engine's max batch size): a row that joins is written into the next spare row; only a
        store without one is reallocated. Concatenating on every admission copied the whole batch:
        ~17-35 ms a join at batch 8 on a 2-core Xeon, more than a decode step, paid by every
        running request. All-or-nothing: on failure (out of memory) the cache is unchanged."""
        need = max(max(other.lengths, default=0), max(self.lengths, default=0))
        self._ensure_capacity(need)
        b, rows, n = self.batch_size, self.batch_size + other.batch_size, self.capacity
        if not self._has_spare_rows(rows):
            self._reallocate(rows, n)
        for layer, (ks, vs) in enumerate(self._stores):
            for store, src in ((ks, other.keys[layer]), (vs, other.values[layer])):
                cols = min(n, src.shape[2])
                store[b:rows, :, :cols].copy_(src[:, :, :cols])
                store[b:rows, :, cols:].zero_()  # masked columns still enter attention: no garbage
            self.keys[layer], self.values[layer] = ks[:rows], vs[:rows]
        self.lengths = self.lengths + list(other.lengths)

    def _has_spare_rows(self, rows: int) -> bool:
        """The buffers are the first rows of ``_stores`` (same storage, same capacity), which hold
        at least ``rows`` rows."""
        stores = self._stores
        if stores is None or len(stores) != self.num_layers:
            return False
        first = stores[0][0]
        if first.shape[0] < rows or first.shape[2] != self.capacity:
            return False
        return all(
            _prefix_of(k, ks) and _prefix_of(v, vs)
            for (ks, vs), k, v in zip(stores, self.keys, self.values)
        )

    def _reallocate(self, rows: int, capacity: int) -> None:
        """New stores of at least ``rows`` rows (twice as many up to ``max_rows``) and
        ``capacity`` columns; the current rows copied in (zeros past their old capacity), the
        buffers their first rows. All-or-nothing: the stores are allocated before anything
        changes. Rows past the current ones are written when a row joins (``append``)."""
        b, old = self.batch_size, self.capacity
        # twice the rows (a few reallocations while a batch fills), never past max_rows: the
        # stores hold at most twice what runs, whatever the max batch size
        total = max(rows, min(self.max_rows, 2 * rows)) if self.max_rows else rows + max(1, rows // 2)
        if self.fixed_capacity is not None:
            total = max(rows, self.max_rows or 1)  # once, for every row the owner will run
        shape = (total, self.num_kv_heads, capacity, self.head_dim)
        # fixed stores are zeroed once: rows that never joined are read by graphs captured before
        # any request ran (``hold_rows``), and 0 * NaN poisons attention
        alloc = torch.zeros if self.fixed_capacity is not None else torch.empty
        stores = [
            (alloc(shape, dtype=self.dtype, device=self.device),
             alloc(shape, dtype=self.dtype, device=self.device))
            for _ in range(self.num_layers)
        ]
        cols = min(old, capacity)
        for (ks, vs), k, v in zip(stores, self.keys, self.values):
            for store, src in ((ks, k), (vs, v)):
                store[:b, :, :cols].copy_(src[:b, :, :cols])
                store[:b, :, cols:].zero_()
        self._stores = stores
        self.keys = [ks[:b] for ks, _ in stores]
        self.values = [vs[:b] for _, vs in stores]
        self.capacity = capacity

    def hold_rows(self, rows: int, length: int) -> None:
        """Make the first ``rows`` rows of the stores live, ``length`` tokens each, copying nothing
        (their contents are whatever the stores hold): an empty cache's batch shaped as a running
        one will be, for capturing CUDA graphs before any request runs. ``clear`` ends it."""
        if self.batch_size:
            raise ValueError("hold_rows needs an empty cache")
        self._ensure_capacity(max(length, 1))
        if not self._has_spare_rows(rows):
            self._reallocate(rows, self.capacity)
        self.keys = [ks[:rows] for ks, _ in self._stores]
        self.values = [vs[:rows] for _, vs in self._stores]
        self.lengths = [length] * rows

    def clear(self) -> None:
        """No rows and nothing pending, the stores kept: what a failed step (or ``hold_rows``) left
        is dropped (a fixed cache's CUDA graphs stay valid; a new cache would need its own)."""
        self.lengths = []
        self._write_rows = self._write_cols = None
        self._tree = None
        self.keys = [k[:0] for k in self.keys]
        self.values = [v[:0] for v in self.values]

    def drop_rows(self, dropped: set[int]) -> list[int]:
        """Remove the rows in ``dropped``: each hole is filled with a surviving row from the end
        (one row copied per hole) and the buffers are cut to the survivors, a view; copying every
        survivor (``index_select``) took 17 ms for 8 rows at context ~500, this 1.4 ms. The
        capacity shrinks (a copy) when it is now far too large. Returns the surviving rows' old
        indices in their new order."""
        order = list(range(len(self.lengths)))
        lo, hi = 0, len(order) - 1
        while True:
            while lo <= hi and order[lo] not in dropped:
                lo += 1
            while hi >= lo and order[hi] in dropped:
                hi -= 1
            if lo >= hi:
                break
            for layer in range(self.num_layers):  # row hi moves into hole lo
                self.keys[layer][lo].copy_(self.keys[layer][hi])
                self.values[layer][lo].copy_(self.values[layer][hi])
            order[lo], order[hi] = order[hi], order[lo]
            lo, hi = lo + 1, hi - 1
        order = [r for r in order if r not in dropped]  # the survivors lead: [0, n)
        self.lengths = [self.lengths[r] for r in order]
        n = len(order)
        target = round_up_columns(max(self.lengths, default=0))
        self.keys = [k[:n] for k in self.keys]  # the survivors lead: views, no copy
        self.values = [v[:n] for v in self.values]
        if self.fixed_capacity is None and target + 2 * _GROW <= self.capacity:  # far too large: a smaller copy
            self._reallocate(n, target)
        return order

    def _ensure_capacity(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        if self.fixed_capacity is not None:
            if needed > self.fixed_capacity:
                raise ValueError(f"{needed} columns past the cache's fixed capacity {self.fixed_capacity}")
            self._reallocate(self.batch_size, self.fixed_capacity)
            return
        # The new columns are zeros, not garbage: masked columns still enter the attention
        # matmul (weight 0), and 0 * NaN from uninitialised memory would poison the output.
        self._reallocate(self.batch_size, round_up_columns(max(needed, int(self.capacity * 1.5))))


def _prefix_of(view: torch.Tensor, store: torch.Tensor) -> bool:
    """``view`` starts where ``store`` does, in its storage (compared by the storage's address:
    the view of no rows, left when the batch empties, has a data_ptr() of 0)."""
    return (
        view.untyped_storage().data_ptr() == store.untyped_storage().data_ptr()
        and view.storage_offset() == 0
    )


def round_up_columns(n: int) -> int:
    """``n`` columns rounded up to the cache's allocation granule (at least one granule)."""
    return max(_GROW, -(-n // _GROW) * _GROW)
