"""LlamaForward: our own forward pass for Llama-family causal LMs (SmolLM2 is one), for TorchEngine.

Why not the Hugging Face forward: on a CPU a decode step is bound by reading the weights once, and
a verify of q = 2..16 tokens should cost about the same. Through ``F.linear`` (x @ W^T) it does
not: MKL runs one row as a streaming gemv, but 2+ rows go through its gemm path, which costs
~1.6-1.9x the one-row time on these 2-core machines (ARCHITECTURE.md, "Decode path"). So every
projection goes through ``kernels.packed_linear``: the weights are repacked once, at build, into
panels that a native kernel streams while it does up to 8 tokens' FMAs, so a verify of up to 8
tokens costs about one pass over the weights. Where that kernel does not build, ``y^T = W @ x^T``
(the weight as the tall left operand) keeps MKL's streaming kernel for up to 4 tokens. We also
fuse q/k/v and gate/up into one matrix each (fewer, longer weight streams) and skip the
framework's per-layer Python. The norms, the MLP activation and the residual adds run inside the
packed kernel's calls. For decode and verify widths, on our ragged cache, rotary + the
cache write + attention are one native call per layer (``kernels.decode_attention``) instead of
~15 small torch ops (measured: 2.7 ms less per step at 1 token, 4.3 ms at 8, on this CPU).

The math is transformers' LlamaForCausalLM with sdpa attention (RMSNorm in fp32, rotary embedding
from the model's own ``rotary_emb``, grouped-query attention), run over the engine's cache through
the same contract: explicit ``position_ids`` [B, q], a bool mask [B, 1, q, L] (ragged rows, token
trees), and ``cache.update(k, v, layer)`` returning the readable keys/values. Results match the
reference to float rounding (tests compare logits and greedy outputs).

``LlamaForward.supports(model)`` says whether a model can use it; other architectures keep the
Hugging Face forward. Engines get theirs from serving/engine/forward_cache.py (one per model and
process, and a learned drafter's reading the target's panels).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels import decode_attention as native_attention
from kernels import packed_linear
from kernels.llama_layers import LayerStack
from kernels.packed_linear import PackedLinear
from serving.engine.batch_cache import RaggedKVCache
from serving.engine.forward_output import ForwardOutput
from serving.engine.rope_table import RopeTable


def _mm_t(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w^T for x [..., K] and w [N, K], computed as (w @ x^T)^T: BLAS's streaming kernel for
    few tokens, where the native kernel is not built (see the module docstring)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])  # [T, K]
    y = torch.mm(w, x2.t())  # [N, T]
    return y.t().reshape(*shape[:-1], w.shape[0])


_THIN_MAX = 4
"""Without the native kernel, token counts up to this use w @ x^T; above it F.linear's gemm is as
good or better (measured)."""


def _tensor_key(t: torch.Tensor) -> tuple:
    """Which tensor ``t`` is (identity and version, not values)."""
    return id(t), t.data_ptr(), tensor_version(t)


def _layer_key(layer: torch.nn.Module) -> tuple:
    """Which tensors a decoder layer's weights are."""
    return tuple(_tensor_key(t) for t in layer.parameters())


def tensor_version(t: torch.Tensor) -> int | None:
    """How often ``t`` was modified in place (None for a tensor made under inference mode)."""
    try:
        return t._version
    except RuntimeError:  # an inference tensor
        return None


class LlamaForward:
    @staticmethod
    def supports(model: torch.nn.Module) -> bool:
        cfg = getattr(model, "config", None)
        if cfg is None or getattr(cfg, "model_type", None) not in ("llama",):
            return False
        if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
            return False
        if getattr(cfg, "hidden_act", "silu") != "silu":
            return False
        inner = getattr(model, "model", None)
        return inner is not None and hasattr(inner, "rotary_emb") and hasattr(model, "lm_head")

    def __init__(
        self, model: torch.nn.Module, thin_max: int | None = None, native: bool | None = None,
        bf16_panels: bool = True, amx: bool = True, *, reuse: LlamaForward | None = None,
        round_to_bf16: bool = False, round_activations: bool = False,
        head_rows: torch.Tensor | None = None, int8_panels: bool = False,
    ):
        """native: serve the projections through kernels.packed_linear (None = where it builds and
        the weights are fp32 on the CPU; the packed copies replace the fused row-major ones);
        bf16_panels: pack a weight whose values are all exactly bf16 as bf16 panels (half the
        bytes a step streams, bit-identical results; kernels/packed_linear.py); amx: those on AMX
        tiles where the CPU has them (a verify of up to 16 tokens for about one step's price);
        thin_max: the BLAS w @ x^T path's limit otherwise.

        For a learned drafter's forward (``forward_cache.drafter_forward``), or the target's read
        with rounded activations: ``reuse``, a forward whose packed layers (and lm_head) this
        model's may share (a layer built from the very same weight tensors is taken as it is, not
        packed again); ``round_to_bf16``, pack the other weights' bf16 roundings (half
        the bytes a draft reads; a draft's numerics move its acceptance, never the output);
        ``round_activations``, round every projection's input to bf16 where the weights are on
        AMX tiles or bf16 panels on a CPU with a bf16 dot product (``PackedLinear.rounded``: a
        third of the tile multiplies, half the dot instructions; projections 2-3x faster from 32
        tokens on, so a drafter commits a request's history 1.4-1.9x faster; the reused target
        layers' panels are read that way too; ``EngineConfig.bf16_activations`` for a target);
        ``head_rows``, read the lm_head at these rows only (a draft vocabulary); ``int8_panels``,
        pack every projection and the head as int8 panels (a drafter's: not exact)."""
        if not self.supports(model):
            raise ValueError(f"LlamaForward does not support {type(model).__name__}")
        cfg = model.config
        inner = model.model  # no reference to ``model`` is kept: forward_cache.py keys on it
        self.num_layers = cfg.num_hidden_layers
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.eps = cfg.rms_norm_eps
        self.rotary = inner.rotary_emb
        self.embed = inner.embed_tokens.weight  # [V, H]
        self.rope = RopeTable(self.rotary, int(getattr(cfg, "max_position_embeddings", 0) or 0),
                              dtype=self.embed.dtype, device=self.embed.device)
        self.final_norm = inner.norm.weight
        self.lm_head = model.lm_head.weight  # [V, H] (tied: the same tensor as embed)
        self.thin_max = _THIN_MAX if thin_max is None else thin_max
        on_cpu_fp32 = self.embed.device.type == "cpu" and self.embed.dtype == torch.float32
        wanted = (native is None or bool(native)) and on_cpu_fp32
        self.native = wanted and packed_linear.available()
        self.bf16_panels = bf16_panels
        self.amx = amx
        self.round_to_bf16 = round_to_bf16
        self.round_activations = round_activations
        self.int8_panels = int8_panels
        self.native_attention = wanted and native_attention.available()
        self.bf16_attention = (
            round_activations and self.native and self.native_attention
            and packed_linear.rounding_available()
            and native_attention.bf16_takes(self.num_heads, self.num_kv_heads, self.head_dim)
        )
        """Attention on bf16 operands, as the projections on rounded activations: a forward that
        rounds takes its attention as a GPU's bf16 attention does (kernels/native/
        attention_tiles_bf16.h), its steps and verifies alike."""
        self.kv_dtype = torch.bfloat16 if self.bf16_attention else self.embed.dtype
        """What the caches this forward runs on hold (``ModelRunner.new_cache``): bf16 where its
        attention reads bf16 operands, which the kernel then rounds once, when it writes them,
        rather than in every tile that reads them (the same bits): half the bytes a step reads
        of the cache, and no conversions (ARCHITECTURE.md, "A bf16 KV cache")."""
        self.layers = []
        self.layer_keys: list[tuple] = [_layer_key(layer) for layer in inner.layers]
        """Per layer, which weight tensors it was built from (``reuse`` matches on them)."""
        reusable = dict(zip(reuse.layer_keys, reuse.layers)) if reuse is not None else {}
        with torch.no_grad():
            for layer, key in zip(inner.layers, self.layer_keys):
                if key in reusable:
                    self.layers.append(tuple(self._read(w) for w in reusable[key]))
                    continue
                a, m = layer.self_attn, layer.mlp
                self.layers.append(
                    (
                        layer.input_layernorm.weight,
                        self._served(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])),
                        self._served(a.o_proj.weight),
                        layer.post_attention_layernorm.weight,
                        self._served(torch.cat([m.gate_proj.weight, m.up_proj.weight])),
                        self._served(m.down_proj.weight),
                    )
                )
            self.head_key = _tensor_key(self.lm_head) if head_rows is None else None
            """Which tensor the whole lm_head was served from (None: a draft vocabulary's rows)."""
            if self.head_key is not None and reuse is not None and reuse.head_key == self.head_key:
                self.lm_head_served = self._read(reuse.lm_head_served)
            else:
                head = self.lm_head if head_rows is None else self.lm_head[head_rows.to(torch.long)]
                self.lm_head_served = self._served(head)
        self.q_dim = self.num_heads * self.head_dim
        self.kv_dim = self.num_kv_heads * self.head_dim
        self.inter = cfg.intermediate_size
        self.scale = self.head_dim**-0.5
        self.stack = None
        """The layers in one native call (kernels/llama_layers.py) where everything in them runs
        natively; None keeps the per-call loop (which gives the same numbers, bit for bit)."""
        if self.native and self.native_attention:
            self.stack = LayerStack.build(
                self.layers, heads=self.num_heads, kv_heads=self.num_kv_heads,
                head_dim=self.head_dim, eps=self.eps, scale=self.scale,
                bf16_attention=self.bf16_attention,
            )

    def layer_by_layer(self) -> LlamaForward:
        """This forward with its layers called one at a time from Python (the path before the
        native stack), over the same packed weights: for a benchmark's before/after in one run."""
        other = copy.copy(self)
        other.stack = None
        return other

    def _served(self, w: torch.Tensor) -> torch.Tensor | PackedLinear:
        """A projection's weight as the forward reads it: packed panels on the native path (a
        copy; the model keeps its own), else row-major."""
        if self.int8_panels and self.native:
            packed = PackedLinear.pack_int8(w.float())
            if packed is not None:
                return packed
        if self.round_to_bf16 and w.dtype == torch.float32:
            w = w.to(torch.bfloat16).float()
        packed = PackedLinear.pack(w, bf16=self.bf16_panels, amx=self.amx) if self.native else None
        return self._read(packed) if packed is not None else w.contiguous()

    def _read(self, w):
        """A served weight as this forward reads it: a packed one with rounded activations when
        ``round_activations``, else with fp32 ones (a reused forward may read the same panels the
        other way); anything else as it is."""
        if not isinstance(w, PackedLinear):
            return w
        return w.rounded() if self.round_activations else w.exact()

    @property
    def rounds(self) -> bool:
        """Whether this forward's projections do read bf16 activations: ``round_activations``
        where the CPU has a bf16 dot product or AMX tiles (elsewhere they stay fp32)."""
        return isinstance(self.lm_head_served, PackedLinear) and self.lm_head_served.rounds_activations

    def weight_tensors(self) -> list[torch.Tensor]:
        """The tensors one decode step reads (every matrix once, as served: packed panels on the
        native path; the tied lm_head once)."""
        out = []
        for w in [*(t for lay in self.layers for t in lay), self.final_norm, self.lm_head_served]:
            out.append(w.panels if isinstance(w, PackedLinear) else w)
        return out

    def weight_bytes(self) -> int:
        """Bytes one decode step reads."""
        return sum(t.numel() * t.element_size() for t in self.weight_tensors())

    def _linear(self, x: torch.Tensor, w: torch.Tensor | PackedLinear) -> torch.Tensor:
        if isinstance(w, PackedLinear):
            return w(x)
        tokens = x.shape[0] * x.shape[1]
        if tokens <= self.thin_max:
            return _mm_t(x, w)
        return F.linear(x, w)

    # On the native path the norm before a projection, the activation before the down
    # projection and the residual add after it run inside the packed kernel's call (the same
    # fp32 math; ~15 fewer torch ops per layer).

    def _normed_linear(self, x: torch.Tensor, norm_w: torch.Tensor, w) -> torch.Tensor:
        """linear(rms_norm(x) * norm_w, w)."""
        if isinstance(w, PackedLinear):
            return w.normed(x, norm_w, self.eps)
        return self._linear(self._norm(x, norm_w), w)

    def _linear_plus(self, x: torch.Tensor, w, residual: torch.Tensor) -> torch.Tensor:
        """residual + linear(x, w)."""
        if isinstance(w, PackedLinear):
            return w(x, residual=residual)
        return residual + self._linear(x, w)

    def _mlp_down_plus(self, gu: torch.Tensor, w, residual: torch.Tensor) -> torch.Tensor:
        """residual + linear(silu(gate) * up, w) for gu = [gate | up]."""
        if isinstance(w, PackedLinear):
            return w.swiglu(gu, residual=residual)
        return residual + self._linear(F.silu(gu[..., : self.inter]) * gu[..., self.inter :], w)

    def _fused_attention_columns(self, cache, mask: torch.Tensor):
        """The cache columns of this step's tokens [B, q] when the native attention kernel can run
        this forward (our ragged fp32 CPU cache), else None. Prefill too: on a 2-core Xeon a
        128-token prompt took 131-135 ms through it against 245-256 through SDPA, 600 tokens 648
        against 766-797, 1024 tokens 1245 against 1294-1352 (torch's ops between our kernels
        leave libgomp's workers spinning against the kernels' own; see kernels/native/pool.h)."""
        if not (self.native_attention and isinstance(cache, RaggedKVCache)):
            return None
        if (not native_attention.cache_dtype_takes(cache.dtype, self.bf16_attention)
                or cache.device.type != "cpu" or mask.dtype != torch.bool):
            return None
        # Each call checks its own tensors (contiguous fp32 on the CPU; the cache's buffers
        # always are); checking all 2 x layers buffers here too cost ~40 us per step.
        return cache.write_columns()

    @staticmethod
    def _packed(row_tokens: torch.Tensor | None, b: int, q: int) -> torch.Tensor | None:
        """[B, q] bool of the real inputs when padding is worth skipping, else None.

        A ragged verify pads every row to the widest (8 rows with one draft between them is 16
        inputs); everything then runs on the real ones only (9): the projections, and attention,
        whose kernel takes each real input as a row of its own with its cache row (``rows``)."""
        if row_tokens is None or q == 1:
            return None
        n = row_tokens.to(torch.long).clamp(1, q)  # [B]
        if int(n.sum()) == b * q:
            return None
        return torch.arange(q)[None, :] < n[:, None]  # [B, q]

    def _attention(self, i: int, qkv, cos, sin, cols, attention_mask, cache,
                   rows: torch.Tensor | None = None) -> torch.Tensor:
        """Layer i's attention: qkv [B, q, Hq*D + 2*Hkv*D] -> [B, q, Hq*D], this step's keys and
        values written to ``cache``. ``rows`` (native path): each of the B rows' cache row."""
        if cols is not None:  # rotary + cache write + attention in one native call
            return native_attention.decode_attention(
                qkv, cos[:, 0], sin[:, 0], cache.keys[i], cache.values[i], cols,
                attention_mask[:, 0], self.num_heads, self.num_kv_heads, self.scale, rows=rows,
                bf16=self.bf16_attention,
            )  # [B, q, Hq*D]
        b, q, _ = qkv.shape
        qd, kvd, d = self.q_dim, self.kv_dim, self.head_dim
        qs = qkv[..., :qd].view(b, q, self.num_heads, d).transpose(1, 2)  # [B, Hq, q, D]
        ks = qkv[..., qd : qd + kvd].view(b, q, self.num_kv_heads, d).transpose(1, 2)
        vs = qkv[..., qd + kvd :].view(b, q, self.num_kv_heads, d).transpose(1, 2)
        qs, ks = self._rope(qs, cos, sin), self._rope(ks, cos, sin)
        keys, values = cache.update(ks, vs, i)  # [B, Hkv, L, D] each
        att = F.scaled_dot_product_attention(
            qs, keys, values, attn_mask=attention_mask, scale=self.scale, enable_gqa=True
        )  # [B, Hq, q, D]
        return att.transpose(1, 2).reshape(b, q, qd)

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused op; bit-identical to the unfused fp32 math
            return F.rms_norm(x, (x.shape[-1],), w, self.eps)
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return w * h.to(x.dtype)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rot * sin

    def __call__(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        past_key_values,
        logits_to_keep: int = 0,
        hidden_layers: tuple[int, ...] = (),
        row_tokens: torch.Tensor | None = None,
        before_layers: Callable[[], None] | None = None,
    ) -> ForwardOutput:
        """input_ids, position_ids [B, q]; attention_mask bool [B, 1, q, L] over the cache after this
        step's update; past_key_values: the engine's cache (``update(k, v, layer) -> (K, V)``).
        ``row_tokens`` [B]: how many of each row's q inputs are real; the rest is padding, whose
        logits come back as zeros (see ``_packed``). ``before_layers()``: called right before the
        layers run (the caller's work for other threads, beside a native stack without the GIL)."""
        b, q = input_ids.shape
        x, cos, sin = self._embed(input_ids, position_ids)
        want = {i % (self.num_layers + 1) for i in hidden_layers}  # -1: the final normed state
        hidden: list[torch.Tensor | None] = [None] * (self.num_layers + 1)
        if 0 in want:
            hidden[0] = x
        cols = self._fused_attention_columns(past_key_values, attention_mask)
        real = self._packed(row_tokens, b, q) if cols is not None and not want and not logits_to_keep else None
        # The residual stream: [B, q, H], or [N, H] of the real inputs only. Attention then takes
        # each real input as a row of one token, with its cache row (padding never computed).
        h, rows, att_args = x, None, (cos, sin, cols, attention_mask)
        if real is not None:
            h = x[real]  # [N, H]
            rows = real.nonzero()[:, 0].contiguous()  # [N] the cache row of each real input
            att_args = (
                cos[:, 0][real][:, None, None].contiguous(),  # [N, 1, 1, D]
                sin[:, 0][real][:, None, None].contiguous(),
                cols[real][:, None].contiguous(),  # [N, 1]
                attention_mask[:, 0][real][:, None, None].contiguous(),  # [N, 1, 1, L]
            )
        if before_layers is not None:
            before_layers()
        h = self._layers(h, att_args, past_key_values, rows, want, hidden)
        if self.num_layers in want:
            hidden[self.num_layers] = self._norm(h, self.final_norm)
        if logits_to_keep:
            h = h[:, -logits_to_keep:]  # the norm is per token: only the kept ones need it
        logits = self.head(h)  # [B, q', V] or [N, V]
        hidden_out = tuple(hidden) if want else None
        if real is not None:
            return ForwardOutput(hidden_states=hidden_out, real=real, real_logits=logits)
        return ForwardOutput(logits, hidden_out)

    def hidden(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
               attention_mask: torch.Tensor, cache, cols: torch.Tensor | None = None) -> torch.Tensor:
        """The residual stream after the last layer, before the final norm: [B, q, H] (a learned
        drafter's forward over its own cache; ``head`` reads it). ``cache``: HF's ``update(k, v,
        layer)``, or with ``cols`` [B, q] (the column each token's keys land at) per-layer
        ``keys``/``values`` buffers [B, Hkv, C, D] that the native attention writes itself."""
        x, cos, sin = self._embed(input_ids, position_ids)
        if not (self.native_attention and cols is not None and attention_mask.dtype == torch.bool):
            cols = None
        return self._layers(x, (cos, sin, cols, attention_mask), cache, None, set(), [])

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits [..., V] (or at the head rows) of pre-norm states h [..., H]."""
        return self._normed_linear(h, self.final_norm, self.lm_head_served)

    def _embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor):
        """Embeddings [B, q, H] and the rotary cos, sin [B, 1, q, D]."""
        x = F.embedding(input_ids, self.embed)  # [B, q, H]
        cos, sin = self.rope(x, position_ids)  # [B, q, D] each
        return x, cos[:, None], sin[:, None]

    def _layers(self, h, att_args, cache, rows, want: set[int], hidden: list) -> torch.Tensor:
        if self.stack is not None and att_args[2] is not None:
            return self._stacked(h, att_args, cache, rows, want, hidden)
        return self._layer_by_layer(h, att_args, cache, rows, want, hidden)

    def _stacked(self, h, att_args, cache, rows, want: set[int], hidden: list) -> torch.Tensor:
        """The layers in one native call; the attention arguments as ``_attention`` passes them."""
        cos, sin, cols, mask = att_args
        h, caught = self.stack(
            h, cos[:, 0], sin[:, 0], cols, mask[:, 0], cache.keys, cache.values, rows=rows,
            hidden_layers=frozenset(want),
        )
        for i, state in caught.items():
            hidden[i] = state
        return h

    def _layer_by_layer(self, h, att_args, cache, rows, want: set[int], hidden: list) -> torch.Tensor:
        """The layers one call (or torch op) at a time: the path wherever the stack cannot run."""
        real = rows is not None
        for i, (ln1, qkv_w, o_w, ln2, gu_w, down_w) in enumerate(self.layers):
            qkv = self._normed_linear(h, ln1, qkv_w)  # [B, q | N, Hq*D + 2*Hkv*D]
            if real:
                att = self._attention(i, qkv[:, None], *att_args, cache, rows=rows)[:, 0]  # [N, Hq*D]
            else:
                att = self._attention(i, qkv, *att_args, cache)  # [B, q, Hq*D]
            h = self._linear_plus(att, o_w, h)  # [B, q | N, H]
            gu = self._normed_linear(h, ln2, gu_w)  # [B, q | N, 2I]
            h = self._mlp_down_plus(gu, down_w, h)  # [B, q | N, H]
            if i + 1 in want and i + 1 < self.num_layers:
                hidden[i + 1] = h
        return h
