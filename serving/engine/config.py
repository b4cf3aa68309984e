"""EngineConfig: the knobs of the embedded TorchEngine."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_batch_size: int = Field(
        8,
        ge=1,
        description="Most requests decoded together in one verify step; more wait their turn.",
    )
    max_waiting: int | None = Field(
        None,
        ge=0,
        description="Admission control: most requests admitted beyond the running batch (queued "
        "for a row). More are refused at once with Overloaded (HTTP 429, Retry-After), so memory "
        "and queueing latency stay bounded under overload. None = unbounded (embedded use: the "
        "HTTP server sets ServingSettings.max_waiting, 64 by default).",
    )
    retry_after_s: float = Field(
        1.0, gt=0, description="Retry-After advertised with a refusal for overload (seconds)."
    )
    k: int = Field(
        4,
        ge=0,
        le=64,
        description="Most tokens drafted per request per step (the policy may choose fewer). "
        "0 = target-only decoding (the benchmark baseline).",
    )
    trace_topk: int = Field(
        20,
        ge=1,
        description="Target top-k (ids, logprobs) recorded per verified position for traces.",
    )
    device: str | None = Field(
        None,
        description="Move the target to this torch device (e.g. 'cpu', 'cuda:0'); None = as loaded.",
    )
    dtype: Literal["bfloat16", "float16", "float32"] | None = Field(
        None, description="Cast the target to this dtype; None = as loaded."
    )
    num_threads: int | None = Field(
        None,
        ge=1,
        description="torch intra-op threads (process-wide, set at start); None = unchanged.",
    )
    serial_step_ops: bool = Field(
        True,
        description="The step thread's own torch ops run serially and only the native kernels "
        "use the intra-op threads: an OpenMP team's idle worker spins for ~15 ms on Intel cores "
        "after each parallel torch op, against the kernels' workers (kernels/threads.py).",
    )
    max_context: int | None = Field(
        None,
        ge=2,
        description="Longest prompt + output in tokens; None = the model's max_position_embeddings "
        "(a larger value is capped to it).",
    )
    forward: Literal["auto", "hf"] = Field(
        "auto",
        description="Target forward: 'auto' = specloop's LlamaForward for Llama-family models with "
        "sdpa attention (fused projections, thin-token matmuls: a verify of a few tokens costs "
        "about one decode step; see serving/engine/llama_forward.py), else Hugging Face's; "
        "'hf' = always Hugging Face's forward (the reference).",
    )
    native_kernels: bool = Field(
        True,
        description="LlamaForward computes every projection with specloop's native CPU kernel "
        "over weights repacked once into panels (kernels/packed_linear.py: a verify of up to 8 "
        "tokens costs about one pass over the weights), built with the machine's C compiler on "
        "first use and cached; where it does not build, BLAS. False = BLAS only.",
    )
    bf16_panels: bool = Field(
        True,
        description="Pack a weight whose values are all exactly bf16 (the default SmolLM2 target's "
        "are: it was dequantised to a bf16 cache) as bf16 panels: a decode step streams half the "
        "bytes, with results bit for bit those of fp32 panels. False = fp32 panels always.",
    )
    amx_panels: bool = Field(
        True,
        description="Where the CPU has AMX-BF16, compute the bf16-exact projections on AMX tiles "
        "(kernels/native/packed_linear_amx.c): a verify of up to 16 tokens costs about one "
        "decode step; fp32-precise, not bit for bit the FMA panels' numbers. Ignored elsewhere "
        "and with bf16_panels off.",
    )
    bf16_activations: bool = Field(
        False,
        description="Round every projection's input (after its norm or activation) to bf16 and "
        "multiply on the CPU's bf16 dot product where it has one (AVX-512 BF16: "
        "kernels/native/packed_linear_dot.c; AMX tiles: one part instead of three), as a GPU's "
        "bf16 matmuls do: twice the multiply-adds per instruction, so verifies of 8-16 tokens cost "
        "far less where the FMAs bound them. Not fp32-exact against the weights (each activation "
        "rounded, relative error up to 2^-9); speculation stays lossless against this engine's own "
        "target-only decoding (every forward of the target runs so). Ignored without such a CPU "
        "and with bf16_panels off.",
    )
    cuda_graphs: bool = Field(
        True,
        description="On CUDA, replay the target's decode and verify forwards as CUDA graphs "
        "(serving/engine/cuda_graphs.py): a step of a small target is otherwise ~450 kernel "
        "launches of host work. The batch cache is then allocated once at its full size, and the "
        "graphs of up to 8 rows are captured when the engine starts. Ignored off CUDA and with "
        "forward='hf'.",
    )
    prefix_cache_tokens: int = Field(
        2048,
        ge=0,
        description="Keep the target's keys and values of up to this many prompt tokens, in blocks "
        "of 8 keyed by the whole prefix, and copy them into a later prompt that starts the same "
        "way instead of prefilling it (serving/engine/prefix_cache.py): a chat template's system "
        "prompt, a conversation's earlier turns. On the CPU fast forward bit for bit a full "
        "prefill's cache (elsewhere up to rounding). 0 = off. Not with drafters that read the "
        "target's hidden states (they need every prompt token's).",
    )
    capture_features: bool = Field(
        False,
        description="Run the target with hidden states even when the drafter needs none, so traces "
        "can carry target features (VerifyBatch.features).",
    )
    feature_layers: tuple[int, ...] = Field(
        (-1,),
        description="HF hidden_states indices captured when capture_features is on and the drafter "
        "names none (-1 = the final, normed hidden state).",
    )
    idle_poll_s: float = Field(
        0.5, gt=0, description="How often an idle step thread re-checks for shutdown (seconds)."
    )
    swap_prepare_nice: int = Field(
        10,
        ge=0,
        le=39,
        description="A hot swap prepares the incoming drafter's per-request state (e.g. prefills "
        "its draft KV cache) on a helper thread this much nicer than the process (Linux), so that "
        "it mostly runs on CPU the decode steps leave idle; 0 = same priority.",
    )
    swap_prepare_timeout_s: float = Field(
        5.0,
        ge=0,
        description="Longest a hot swap spends preparing requests off the step thread; requests "
        "not prepared by then are rebuilt between two steps when the drafter is installed.",
    )
