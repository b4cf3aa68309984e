"""``specloop bench engine``: how close a decode step runs to the memory bound, and what a verify of
q tokens costs in one-token steps, for TorchEngine's forward and the Hugging Face reference, in one
run (so the before/after ratio is measured on the same machine at the same time).

- ``bandwidth_gbs``: read bandwidth, the faster of two medians sampled between the timed forwards:
  summing the weights the step reads (``bandwidth_gbs_weights``: the same pages) and summing a
  fresh 256 MB fp32 tensor (``bandwidth_gbs_256mb_tensor``, the figure earlier runs reported).
  This VM's bandwidth moves with its neighbours and with where an allocation lands.
- ``bound_ms`` = weight bytes / bandwidth: the least a decode step can cost (every weight read once).
- ``step_ms``: one-token forward at context ``--context``, batch 1, median, timed on a thread set
  up as serving's step thread (its own torch ops serial, kernels/threads.py); ``bound_fraction`` =
  bound_ms / step_ms. ``step_ms_plain_thread``: the same from a thread left as torch starts it.
- ``verify_cost["q"]``: forward of q tokens / one-token forward, same context.
- ``verify_cost_tree["q"]``: the fast path's forward of a token tree of q nodes (the root and two
  children a node, in level order) / one-token forward: each node attends to the prefix and its
  ancestors only, a mask with holes, where a chain's tokens each see a prefix.
- ``lossless``: greedy outputs of the fast path equal the reference forward's on a few prompts
  (for a fast path on bf16 activations, the reference with every Linear's input rounded to bf16
  and, where the fast path takes its attention on bf16 operands (``bf16_attention``), its
  attention computed that way: serving.engine.reference.rounded_arithmetic, the same arithmetic
  up to the order of fp32 additions).
- ``bf16_activations``: whether the fast path (serving's default; ``--exact-activations`` turns it
  off) rounds each projection's input to bf16 and multiplies on the CPU's bf16 dot product or AMX
  tiles (EngineConfig.bf16_activations). Where it does, ``exact_activations`` times the same
  forward on fp32 activations in the same run (``speedup_vs_exact_activations``: its ms / the fast
  path's), and ``greedy_agreement_with_fp32_reference`` says how much of the fp32 reference's
  greedy output the fast path reproduces before its first difference; where the fast path is
  exact and the CPU could round, ``bf16_activations_path`` times the rounded one.
- ``startup_s``: model load + building the fast forward + a warm-up forward.
- ``fp32_panels``: where the fast forward streams bf16 panels (weights that are exactly bf16, as
  the default target's are), the same forward over fp32 panels, timed in the same run
  (``speedup_vs_fp32_panels``: its ms / the fast path's).
- ``fma_panels``: where the fast forward computes its projections on AMX tiles (CPUs with
  AMX-BF16; kernels/native/packed_linear_amx.c), the same forward with the FMA kernel over the
  same bf16 panels, as before (``speedup_vs_fma_panels``).
- ``without_cuda_graphs``: on CUDA, where the fast forward's steps replay CUDA graphs
  (serving/engine/cuda_graphs.py), the same forward launched op by op, as before
  (``speedup_vs_without_cuda_graphs``); ``cuda_graphs``: how many were captured, in how long.
- ``kv_cache_dtype`` / ``fp32_kv_cache``: where the fast forward's attention is on bf16 operands
  its caches hold bf16 (``LlamaForward.kv_dtype``); ``fp32_kv_cache`` times the same forward on an
  fp32 cache, as before, in the same run (``speedup_vs_fp32_kv_cache``: its ms / the fast path's).
- ``layer_by_layer``: where the fast forward runs its layers in one native call
  (kernels/llama_layers.py), the same forward over the same weights with the layers called one at
  a time from Python, as before (``speedup_vs_layer_by_layer``).
"""

from __future__ import annotations

import logging
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import typer

from benchmarks.engine_options import bf16_activations_option
from benchmarks.output import json_option, print_json
from kernels import packed_linear
from kernels.cpu import cpu_info
from kernels.threads import serial_torch
from kernels.tree_verify import tree_ancestors, tree_depths

log = logging.getLogger(__name__)

_QS = (2, 4, 8, 16, 32)
_TREE_QS = (8, 16)


class BandwidthProbe:
    """Read bandwidth: the time to sum ``tensors`` (the weights a decode step reads, so that the
    bound is measured on the same pages the step streams), or a fresh 256 MB fp32 tensor. This
    VM's bandwidth moves with its neighbours and with where an allocation lands (one process read
    34 GB/s from a 256 MB tensor and 60 GB/s from a 1 GB one), so ``run`` samples it between the
    timed forwards and reports the median of those samples."""

    def __init__(self, tensors: list[torch.Tensor] | None = None, mb: int = 256,
                 device: torch.device | str = "cpu"):
        self.tensors = tensors or [torch.ones(mb * 2**20 // 4, dtype=torch.float32, device=device)]
        self.bytes = sum(t.numel() * t.element_size() for t in self.tensors)
        on_gpu = self.tensors[0].device.type == "cuda"
        self._sync = torch.cuda.synchronize if on_gpu else (lambda: None)
        self._read()
        self.times: list[float] = []

    def _read(self) -> None:
        self._sync()
        for t in self.tensors:
            t.sum()
        self._sync()

    def sample(self) -> None:
        t0 = time.perf_counter()
        self._read()
        self.times.append(time.perf_counter() - t0)

    def gbs(self) -> float:
        return self.bytes / statistics.median(self.times) / 1e9


class _Path:
    """One forward implementation over a prefilled cache, timed without committing anything."""

    def __init__(self, name: str, engine, step_thread: bool = False, cache_dtype: torch.dtype | None = None):
        self.name, self.engine = name, engine
        self.step_thread = step_thread  # timed on a thread set up as serving's step thread
        self.cache_dtype = cache_dtype
        """The KV cache's dtype; None: what the engine's own caches hold (``new_cache``)."""

    def new_cache(self):
        from serving.engine.batch_cache import RaggedKVCache

        if self.cache_dtype is None:
            return self.engine.runner.new_cache(batch_size=1)
        return RaggedKVCache.for_model(self.engine.model, batch_size=1, dtype=self.cache_dtype)

    def forward_ms(self, cache, q: int, vocab: int, tree: bool = False) -> float:
        ids = torch.randint(0, vocab, (1, q))
        if tree:  # a binary tree in level order: node i's parent is (i - 1) // 2
            parents = torch.tensor([[-1] + [(i - 1) // 2 for i in range(1, q)]])
            cache.set_tree(tree_depths(parents), tree_ancestors(parents))
        sync = torch.cuda.synchronize if cache.device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        self.engine.runner.forward(cache, ids)
        sync()
        return (time.perf_counter() - t0) * 1e3


def _panel_layout(engine) -> str | None:
    """"amx", "bf16" or "fp32": how the fast forward's lm_head is packed (None: not natively)."""
    fast = engine.runner.fast
    if fast is None or not fast.native:
        return None
    return fast.lm_head_served.layout


_PANEL_DTYPE = {"amx": "bfloat16", "bf16": "bfloat16", "fp32": "float32"}
"""The panels' dtype by layout (the ``panels`` field earlier runs reported)."""


def _rounds(engine) -> bool:
    """Whether ``engine``'s target forward rounds its activations, or could (a bf16 dot product or
    AMX tiles; elsewhere ``rounded()`` changes nothing)."""
    head = engine.runner.fast.lm_head_served
    return isinstance(head, packed_linear.PackedLinear) and (head.rounds_activations or head.rounded() is not head)


def _agreement(got: list[list[int]], want: list[list[int]]) -> float:
    """The share of reference tokens each greedy run reproduced before its first difference."""
    same = 0
    for g, w in zip(got, want):
        same += next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
    return round(same / max(1, sum(len(w) for w in want)), 3)


def _greedy(engine, prompt: list[int], n: int) -> list[int]:
    cache = engine.runner.new_cache(batch_size=1)
    out = engine.runner.forward(cache, torch.tensor([prompt]), logits_to_keep=1)
    cache.commit([len(prompt)])
    toks = [int(out.logits[0, -1].argmax())]
    for _ in range(n - 1):
        out = engine.runner.forward(cache, torch.tensor([[toks[-1]]]))
        cache.commit([1])
        toks.append(int(out.logits[0, -1].argmax()))
    return toks


def run(threads: int, context: int, reps: int, device: str | None, tiny: bool, lossless_tokens: int,
        prefix_prompts: int = 0, bf16_activations: bool = False) -> dict:
    from serving.engine.batch_cache import RaggedKVCache
    from serving.engine.config import EngineConfig
    from serving.engine.reference import rounded_arithmetic
    from serving.engine.torch_engine import TorchEngine
    from serving.target import load_target, tiny_target

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    target = tiny_target(vocab_size=512, hidden_size=128, num_layers=4) if tiny else load_target(None)
    if device:
        target.model.to(device)
    fast = TorchEngine(target, config=EngineConfig(k=0, forward="auto", bf16_activations=bf16_activations))
    rounds = fast.runner.fast is not None and fast.runner.fast.native and _rounds(fast)
    with torch.inference_mode():
        warm = fast.runner.new_cache(batch_size=1)
        fast.runner.forward(warm, torch.zeros(1, 8, dtype=torch.long))
    startup_s = time.perf_counter() - t0
    ref = TorchEngine(target, config=EngineConfig(k=0, forward="hf"))
    vocab = fast.vocab_size
    paths = [_Path("fast", fast, step_thread=True), _Path("reference", ref)]
    native = fast.runner.fast is not None and fast.runner.fast.native
    if native:  # the same forward on BLAS alone: what the native kernel buys, in the same run
        blas = TorchEngine(target, config=EngineConfig(k=0, forward="auto", native_kernels=False))
        paths.insert(1, _Path("blas", blas))
    layout = _panel_layout(fast)
    panels = _PANEL_DTYPE.get(layout)
    if panels == "bfloat16":  # the same kernel over fp32 panels: what half the bytes buys
        fp32 = TorchEngine(target, config=EngineConfig(k=0, forward="auto", bf16_panels=False))
        paths.insert(1, _Path("fp32_panels", fp32, step_thread=True))
    if layout == "amx":  # the same bf16 weights on the FMA kernel: what the tiles buy
        fma = TorchEngine(target, config=EngineConfig(k=0, forward="auto", amx_panels=False))
        paths.insert(1, _Path("fma_panels", fma, step_thread=True))
    other = None  # the same panels with the other activations: what the bf16 dot product buys
    if rounds:
        other = TorchEngine(target, config=EngineConfig(k=0, forward="auto", bf16_activations=not bf16_activations))
        paths.insert(1, _Path("other_activations", other, step_thread=True))
    kv_dtype = fast.runner.new_cache().dtype
    if kv_dtype != torch.float32:  # the same forward on an fp32 cache: what the bf16 cache buys
        paths.insert(1, _Path("fp32_kv_cache", fast, step_thread=True, cache_dtype=torch.float32))
    graphs = fast.runner.graphs
    if graphs is not None:  # the same forward launched op by op: what the CUDA graphs buy
        eager = TorchEngine(target, config=EngineConfig(k=0, forward="auto", cuda_graphs=False))
        paths.insert(1, _Path("eager_launches", eager))
    stacked = fast.runner.fast is not None and fast.runner.fast.stack is not None
    if stacked:  # the same weights, the layers called from Python: what one native call buys
        per_call = TorchEngine(target, config=EngineConfig(k=0, forward="auto"))
        per_call.runner.fast = fast.runner.fast.layer_by_layer()
        paths.insert(1, _Path("layer_by_layer", per_call, step_thread=True))
    served = fast.runner.fast.weight_tensors() if fast.runner.fast is not None else None
    probe = BandwidthProbe(served)  # the weights themselves, where the fast forward has them
    probe_256mb = BandwidthProbe(device=target.device)  # a separate allocation, for comparison with earlier runs
    weight_bytes = (
        fast.runner.fast.weight_bytes()
        if fast.runner.fast is not None
        else sum(p.numel() * p.element_size() for p in target.model.parameters())
    )
    times: dict[str, dict[int, list[float]]] = {p.name: {q: [] for q in (1,) + _QS} for p in paths}
    tree_ms: dict[int, list[float]] = {q: [] for q in _TREE_QS}  # the fast path's
    # The fast paths run where serving runs them: on a step thread whose own torch ops are serial
    # (kernels/threads.py); the reference paths (HF, BLAS) on this thread. Each timed forward follows an
    # untimed one of the same path, so that the OpenMP workers a reference forward left spinning
    # (~15 ms on Intel) are asleep again, as they would be in serving.
    step_thread = ThreadPoolExecutor(1, thread_name_prefix="bench-step-thread",
                                     initializer=serial_torch, initargs=(threads,))

    def timed(p: _Path, cache, q: int, tree: bool = False) -> float:
        def twice() -> float:
            with torch.inference_mode():
                p.forward_ms(cache, q, vocab, tree)
                return p.forward_ms(cache, q, vocab, tree)

        return step_thread.submit(twice).result() if p.step_thread else twice()

    with torch.inference_mode():
        # One prefilled cache per dtype the paths keep theirs in (the fast forward's bf16 where its
        # attention is bf16, else fp32), shared by the paths of that dtype.
        prompt = torch.randint(0, vocab, (1, context))
        prefilled: dict[torch.dtype, RaggedKVCache] = {}
        caches: dict[str, RaggedKVCache] = {}
        for p in paths:
            fresh = p.new_cache()
            if fresh.dtype not in prefilled:
                fast.runner.forward(fresh, prompt, logits_to_keep=1)
                fresh.commit([context])
                prefilled[fresh.dtype] = fresh
            caches[p.name] = prefilled[fresh.dtype]
        cache = caches[paths[0].name]
        for p in paths:  # warm every path at every width
            for q in (1,) + _QS:
                timed(p, caches[p.name], q)
        for q in _TREE_QS:
            timed(paths[0], cache, q, tree=True)
        for _ in range(reps):  # interleaved, so drift on a shared machine hits all alike
            for q in (1,) + _QS:
                probe.sample()
                probe_256mb.sample()
                for p in paths:
                    times[p.name][q].append(timed(p, caches[p.name], q))
            for q in _TREE_QS:
                tree_ms[q].append(timed(paths[0], cache, q, tree=True))
        step_thread.shutdown()
        # The one-token step from a plain thread (torch ops parallel, as before serving made its
        # step thread's serial): what the serial step thread saves.
        thread_ms: list[float] = []

        def on_a_thread() -> None:
            with torch.inference_mode():
                for _ in range(reps):
                    thread_ms.append(paths[0].forward_ms(cache, 1, vocab))

        worker = threading.Thread(target=on_a_thread, name="bench-plain-thread")
        worker.start()
        worker.join()
        # The bound uses the faster of the two reads: never flattered by slow pages of one.
        bw = max(probe.gbs(), probe_256mb.gbs())
        prompts = [[1, 504, 3101, 314, 253, 6467, 28], [1, 4093, 15, 1392, 314, 260], [1, 2683, 1259, 30]]
        prompts = [[t % vocab for t in pr] for pr in prompts]
        fp32_tokens = [_greedy(ref, pr, lossless_tokens) for pr in prompts]
        rounded = rounds and bf16_activations
        with rounded_arithmetic(target.model, linear=rounded, attention=rounded and fast.runner.fast.bf16_attention):
            reference_tokens = [_greedy(ref, pr, lossless_tokens) for pr in prompts] if rounded else fp32_tokens
        fast_tokens = [_greedy(fast, pr, lossless_tokens) for pr in prompts]
        lossless = fast_tokens == reference_tokens

    def figures(name: str) -> dict:
        med = {q: statistics.median(v) for q, v in times[name].items()}
        step = med[1]
        engine = next(p.engine for p in paths if p.name == name)
        nbytes = engine.runner.fast.weight_bytes() if engine.runner.fast is not None else weight_bytes
        return {
            "step_ms": round(step, 2),
            "bound_fraction": round(nbytes / bw / 1e6 / step, 3),
            "verify_cost": {str(q): round(med[q] / step, 3) for q in _QS},
            "verify_ms": {str(q): round(med[q], 2) for q in _QS},
        }

    out = {
        "model": target.model_id,
        "dtype": str(target.model.dtype).replace("torch.", ""),
        "device": str(target.device),
        "threads": threads,
        "context": context,
        "cpu": cpu_info(),
        "bandwidth_gbs": round(bw, 2),
        "bandwidth_gbs_weights": round(probe.gbs(), 2) if served else None,
        "bandwidth_gbs_256mb_tensor": round(probe_256mb.gbs(), 2),
        "weight_bytes": weight_bytes,
        "bound_ms": round(weight_bytes / bw / 1e6, 2),
        "forward": "llama_forward" if fast.runner.fast is not None else "hf",
        "native_kernel": {
            "used": native,
            "kernel": "packed_linear",
            "panel_width": packed_linear.panel_width(),
            "panels": panels,
            "layout": layout,
            "layer_stack": stacked,
            "group_layout": fast.runner.group_layout,
            "stream_hint": fast.runner.stream_hint,
        },
        **figures("fast"),
        "verify_cost_tree": {
            str(q): round(statistics.median(v) / statistics.median(times["fast"][1]), 3)
            for q, v in tree_ms.items()
        },
        "step_ms_plain_thread": round(statistics.median(thread_ms), 2),
        "startup_s": round(startup_s, 2),
        "lossless": lossless,
        "bf16_activations": rounded,
        "bf16_attention": rounded and fast.runner.fast.bf16_attention,
        "greedy_agreement_with_fp32_reference": _agreement(fast_tokens, fp32_tokens),
        "reference": figures("reference"),
    }
    if native:
        out["without_native_kernel"] = figures("blas")
    if panels == "bfloat16":
        out["fp32_panels"] = figures("fp32_panels")
        out["fp32_panels"]["weight_bytes"] = fp32.runner.fast.weight_bytes()
        out["speedup_vs_fp32_panels"] = _speedup(out["fp32_panels"], out)
    if layout == "amx":
        out["fma_panels"] = figures("fma_panels")
        out["speedup_vs_fma_panels"] = _speedup(out["fma_panels"], out)
    if other is not None and rounded:
        out["exact_activations"] = figures("other_activations")
        out["speedup_vs_exact_activations"] = _speedup(out["exact_activations"], out)
    elif other is not None:
        out["bf16_activations_path"] = figures("other_activations")
        out["speedup_vs_bf16_activations"] = _speedup(out["bf16_activations_path"], out)
    if graphs is not None:
        out["cuda_graphs"] = {"captured": graphs.captures, "capture_s": round(graphs.capture_s, 2),
                              "failure": graphs.failure}
        out["without_cuda_graphs"] = figures("eager_launches")
        out["speedup_vs_without_cuda_graphs"] = _speedup(out["without_cuda_graphs"], out)
    if kv_dtype != torch.float32:
        out["kv_cache_dtype"] = str(kv_dtype).replace("torch.", "")
        out["fp32_kv_cache"] = figures("fp32_kv_cache")
        out["speedup_vs_fp32_kv_cache"] = _speedup(out["fp32_kv_cache"], out)
    if stacked:
        out["layer_by_layer"] = figures("layer_by_layer")
        out["speedup_vs_layer_by_layer"] = _speedup(out["layer_by_layer"], out)
    out["speedup_vs_reference"] = _speedup(out["reference"], out)
    if prefix_prompts and not tiny:
        out["prefix_cache"] = _prefix_cache(target, prefix_prompts)
    return out


def _prefix_cache(target, n: int) -> dict:
    """The prefix cache on the project's prompts (MT-Bench chat then HumanEval) and on held-out
    ShareGPT (``n`` chat then ``n`` code prompts each, in serving order)."""
    from benchmarks.prefill import prefix_cache_figures
    from infra.prompts import encode, load_sharegpt, stream_items

    streams = {"mtbench_humaneval": stream_items(None, n, n), "sharegpt": load_sharegpt(n, n)}
    return prefix_cache_figures(target, {name: [p for p, _ in encode(items, target.tokenizer)]
                                         for name, items in streams.items()})


def _speedup(other: dict, fast: dict) -> dict:
    """The other path's ms / the fast path's, for the step and each verify width."""
    return {
        "step": round(other["step_ms"] / fast["step_ms"], 3),
        **{str(q): round(other["verify_ms"][str(q)] / fast["verify_ms"][str(q)], 3) for q in _QS},
    }


def bench_engine(
    json_out: bool = json_option(),
    threads: int = typer.Option(2, min=1, help="torch threads."),
    context: int = typer.Option(256, min=1, help="Tokens already in the cache when timing."),
    reps: int = typer.Option(9, min=1, help="Timed forwards per width and path (median)."),
    device: str = typer.Option(None, help="torch device for the target (e.g. cuda:0); default as loaded."),
    tiny: bool = typer.Option(False, "--tiny", help="A tiny random model (smoke runs)."),
    lossless_tokens: int = typer.Option(24, min=1, help="Greedy tokens per prompt for the lossless check."),
    prefix_prompts: int = typer.Option(24, min=0, help="Chat and code prompts per stream for the prefix "
                                       "cache's prefill figures (0 = skip them)."),
    bf16_activations: bool = bf16_activations_option(),
) -> None:
    """Decode step vs the memory bound, and verify cost by width: fast path vs HF reference."""
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
    out = run(threads, context, reps, device, tiny, lossless_tokens, prefix_prompts, bf16_activations)
    print_json(out, json_out)
