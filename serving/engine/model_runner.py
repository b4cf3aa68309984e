"""ModelRunner: the target model behind TorchEngine, and the one place it is called.

It owns the forward path (our LlamaForward when the model allows it, else the Hugging Face
forward with a 4-D mask), the KV caches' shape, and the target features drafters may want (hidden
states of ``feature_layers``, concatenated). The engine's step thread is its only caller.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from kernels.group_layout import tune_group_layout
from kernels.stream_hint import tune_stream_hint
from serving.engine.batch_cache import RaggedKVCache, round_up_columns
from serving.engine.cuda_graphs import StepGraphs
from serving.engine.forward_cache import shared_forward
from serving.engine.llama_forward import LlamaForward
from serving.engine.prefix_cache import PrefixCache

log = logging.getLogger(__name__)

PRECAPTURED_ROWS = 8
"""Row counts whose graphs a GPU batch cache captures when it is made (each ~2 x 5 graphs of ~90
ms on an H100); larger batches capture theirs when they first run."""


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        forward: str = "auto",
        native_kernels: bool = True,
        bf16_panels: bool = True,
        amx_panels: bool = True,
        cuda_graphs: bool = True,
        bf16_activations: bool = False,
        prefix_cache_tokens: int = 0,
    ):
        self.model = model
        self.device = torch.device(device)
        attn = getattr(model.config, "_attn_implementation", "sdpa") or "sdpa"
        if attn not in ("sdpa", "eager"):
            raise ValueError(f"TorchEngine supports sdpa or eager attention, not {attn!r}")
        self._additive_mask = attn == "eager"
        self.fast: LlamaForward | None = None
        """Our own forward (serving/engine/llama_forward.py) when ``forward="auto"`` and the
        model is a Llama-family model on sdpa; None runs the Hugging Face forward."""
        if forward == "auto" and attn == "sdpa" and LlamaForward.supports(model):
            self.fast = shared_forward(model, native=None if native_kernels else False,
                                       bf16_panels=bf16_panels, amx=amx_panels,
                                       round_activations=bf16_activations)
        self.group_layout: dict | None = None
        """How the FMA kernel's token groups share a panel's stream here, timed once per process
        on the lm_head (kernels/group_layout.py); None where nothing was decided."""
        self.stream_hint: dict | None = None
        """How it prefetches a panel streamed once (a step, a verify of one group), timed the
        same way (kernels/stream_hint.py); None where nothing was decided."""
        if self.fast is not None and self.device.type == "cpu":
            self.group_layout = tune_group_layout(self.fast.lm_head_served)
            if self.group_layout is not None:
                log.info("token groups in %s (%s)", self.group_layout["layout"], self.group_layout)
            self.stream_hint = tune_stream_hint(self.fast.lm_head_served)
            if self.stream_hint is not None:
                log.info("panels streamed once prefetched %s (%s)", self.stream_hint["hint"], self.stream_hint)
        self.graphs: StepGraphs | None = None
        """The fast forward's decode and verify steps as CUDA graphs (serving/engine/cuda_graphs.py)
        when the model is on CUDA and ``cuda_graphs`` is on; None runs every forward eagerly."""
        if self.fast is not None and cuda_graphs and self.device.type == "cuda":
            self.graphs = StepGraphs(self.fast)
        self.feature_layers: tuple[int, ...] = ()
        """Hidden-state layers the current drafter wants with every forward (() = none)."""
        self.prefix_cache = PrefixCache(max_tokens=prefix_cache_tokens) if prefix_cache_tokens else None
        """Keys and values of prompt prefixes prefilled before (serving/engine/prefix_cache.py);
        None: every prompt is prefilled whole."""

    def new_cache(self, batch_size: int | None = None, max_rows: int | None = None) -> RaggedKVCache:
        """An empty cache of ``batch_size`` rows (0 if None) that will hold at most ``max_rows``
        (default: ``batch_size``, else unknown): its buffers keep that many rows' room, so that a
        row joins without a copy of the batch (``RaggedKVCache.append``)."""
        dtype = self.fast.kv_dtype if self.fast is not None else None  # bf16 for bf16 attention
        cache = RaggedKVCache.for_model(self.model, batch_size=batch_size or 0, dtype=dtype)
        cache.max_rows = max_rows if max_rows is not None else batch_size
        return cache

    def new_batch_cache(self, max_rows: int, max_context: int, widest: int) -> RaggedKVCache:
        """The running batch's cache (TorchEngine's ``_cache``), for at most ``max_rows`` rows.

        With CUDA graphs its stores are fixed (``RaggedKVCache.fixed_capacity``): ``max_rows``
        rows of ``max_context`` columns plus the widest padded verify, allocated once, so that the
        graphs' buffers never move, where that takes at most a quarter of the GPU's free memory
        (SmolLM2, 8 rows, fp32: 3.1 GB); and the graphs of up to ``widest`` tokens per row for
        up to ``PRECAPTURED_ROWS`` rows are captured now, before any request waits on them
        (``StepGraphs.precapture``)."""
        cache = self.new_cache(max_rows=max_rows)
        graphs = self.graphs
        if graphs is None or (graphs.capture and self.device.type != "cuda"):
            return cache  # (graphs with capture off: the CPU tests of this path)
        capacity = round_up_columns(max_context + max(graphs.max_tokens, widest))
        per_column = 2 * cache.num_layers * cache.num_kv_heads * cache.head_dim * cache.dtype.itemsize
        free = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else None
        if free is not None and max_rows * capacity * per_column > free // 4:
            log.warning("fixed KV stores of %d rows x %d columns would take over a quarter of the "
                        "GPU's free memory: the cache grows as it goes, and graphs are captured "
                        "again where it moves", max_rows, capacity)
            return cache
        cache.fixed_capacity = capacity
        if self.feature_layers:  # the drafter wants hidden states: these steps stay eager for now
            return cache
        t0 = time.perf_counter()
        rows = range(1, min(max_rows, PRECAPTURED_ROWS) + 1)
        n = graphs.precapture(cache, rows, min(widest, graphs.max_tokens))
        log.info("captured %d step graphs in %.1f s", n, time.perf_counter() - t0)
        return cache

    def forward(self, cache: RaggedKVCache, input_ids: torch.Tensor, logits_to_keep: int = 0,
                row_tokens: torch.Tensor | None = None, before_layers: Callable[[], None] | None = None):
        """One target forward of ``input_ids`` [B, q] appended to ``cache`` (uncommitted until the
        caller commits); ``.logits`` [B, q or logits_to_keep, V], ``.hidden_states`` when
        ``feature_layers`` are set. ``row_tokens`` [B]: row b's inputs beyond its first
        ``row_tokens[b]`` are padding (their logits are not read; the fast forward may skip them).
        ``before_layers()``: called once the layers are about to run (natively, without the GIL,
        on the fast path): work for other threads to do beside them (serving/engine/outbox.py)."""
        positions, mask = cache.prepare(input_ids.shape[1])  # [B, q], [B, 1, q, L]
        graphs = self.graphs
        if graphs is not None and graphs.applies(cache, input_ids.shape[1], logits_to_keep, self.feature_layers):
            if before_layers is not None:
                before_layers()
            return graphs(cache, input_ids.to(self.device), positions, mask)
        if self.fast is not None:
            return self.fast(input_ids.to(self.device), positions, mask, cache,
                             logits_to_keep=logits_to_keep, hidden_layers=self.feature_layers,
                             row_tokens=row_tokens, before_layers=before_layers)
        if before_layers is not None:
            before_layers()
        if self._additive_mask:
            mask = torch.zeros(mask.shape, dtype=self.model.dtype, device=mask.device).masked_fill(
                ~mask, torch.finfo(self.model.dtype).min
            )
        return self.model(
            input_ids=input_ids.to(self.device),
            position_ids=positions,
            attention_mask=mask,
            past_key_values=cache,
            use_cache=True,
            output_hidden_states=bool(self.feature_layers),
            logits_to_keep=logits_to_keep,
        )

    def features(self, out) -> torch.Tensor | None:
        """The drafter's features of a forward's inputs: [B, q, F], or None when none are wanted."""
        if not self.feature_layers:
            return None
        return torch.cat([out.hidden_states[i] for i in self.feature_layers], dim=-1)  # [B, q, F]

    @property
    def feature_dim(self) -> int:
        return int(self.model.config.hidden_size) * len(self.feature_layers)

    def no_features(self) -> torch.Tensor:
        return torch.zeros(0, self.feature_dim, dtype=self.model.dtype, device=self.device)  # [0, F]

    def prefill(self, prompt_ids: list[int]) -> tuple[RaggedKVCache, torch.Tensor | None]:
        """A batch-1 cache holding prompt[:-1] (the last prompt token is the first verify step's
        input), and its features [P-1, F] (None if not wanted). With a prefix cache (and no
        features wanted: it keeps none), a cached start of the prompt is copied in, not computed."""
        cache = self.new_cache(batch_size=1)
        tokens = prompt_ids[:-1]
        n = len(tokens)
        if n == 0:
            return cache, (self.no_features() if self.feature_layers else None)
        prefixes = self.prefix_cache if not self.feature_layers else None
        cached = 0
        if prefixes is not None:
            cached, keys, values = prefixes.lookup(tokens[:-1])  # at least one token is computed
            if cached:
                cache.seed(keys, values)
            prefixes.hit_tokens += cached
            prefixes.prefilled_tokens += n - cached
        out = self.forward(cache, torch.tensor([tokens[cached:]]), logits_to_keep=1)
        cache.commit([n - cached])
        if prefixes is not None:
            prefixes.insert(tokens, [k[0] for k in cache.keys], [v[0] for v in cache.values])
        feats = self.features(out)
        return cache, None if feats is None else feats[0]

    def recompute_features(self, token_ids: list[int]) -> torch.Tensor:
        """Features [len, F] of ``token_ids`` from one cache-less forward (a swapped-in drafter
        wants layers the history was not captured with)."""
        if not token_ids:
            return self.no_features()
        out = self.model(input_ids=torch.tensor([token_ids], device=self.device), use_cache=False,
                         output_hidden_states=True, logits_to_keep=1)
        return self.features(out)[0]  # [len, F]
