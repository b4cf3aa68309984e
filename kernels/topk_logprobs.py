"""topk_logprobs: the ``t`` largest logits of each row and their log-probabilities, as traces
record the target's top-k at every verified position.

The torch reference reads each row three times (topk, logsumexp, and a gather before them); the
native kernel (``kernels/native/topk_logprobs.c``) reads it once and once more from cache: ~4x
less time for a 4 x 5-position verify step on this CPU. Ids come back in descending order of
logit; log-probs agree with the reference to ~1e-6.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from kernels import native_build, threads

MAX_T = 64

PARALLEL_ROWS = 3
"""Fewest rows worth waking the pool's workers for: on a 2-core AMD EPYC (before the kernel's
blocked first pass) one row on two threads took 67 us cold against 41 on the caller alone, two rows
94 against 83, three 94 against 109. A batch-1 step traces one or two rows."""


def _declare(lib: ctypes.CDLL) -> None:
    lib.topk_logprobs.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_int,
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
    ]
    lib.topk_logprobs.restype = ctypes.c_int
    lib.topk_logprobs_padded.argtypes = [
        ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_int, ctypes.c_void_p,
        ctypes.c_void_p, ctypes.c_int, ctypes.c_long,
    ]
    lib.topk_logprobs_padded.restype = ctypes.c_long


def available() -> bool:
    return native_build.load("topk_logprobs", _declare) is not None


def topk_logprobs_reference(logits: torch.Tensor, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V] -> (ids [N, t] int64, log-probs [N, t] fp32), descending."""
    values, ids = logits.topk(t, dim=-1)  # [N, t]
    return ids, values.float() - torch.logsumexp(logits.float(), dim=-1, keepdim=True)


def topk_logprobs(
    logits: torch.Tensor, t: int, rows: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, V] -> (ids [N, t] int64, log-probs [N, t] fp32), descending, for the rows
    ``rows`` [N] (None: every row, N = R; the native kernel reads the chosen rows in place)."""
    count, vocab = logits.shape
    t = min(t, vocab)
    native = logits.device.type == "cpu" and logits.dtype == torch.float32 and 1 <= t <= MAX_T
    lib = native_build.load("topk_logprobs", _declare) if native else None
    if lib is None:
        chosen = logits if rows is None else logits.index_select(0, rows.to(logits.device))
        return topk_logprobs_reference(chosen, t)
    x = logits.contiguous()
    idx = None if rows is None else rows.to(torch.long).contiguous()
    n = count if idx is None else idx.shape[0]
    ids = torch.empty(n, t, dtype=torch.long, device="cpu")
    lp = torch.empty(n, t, dtype=torch.float32, device="cpu")
    rc = lib.topk_logprobs(x.data_ptr(), idx.data_ptr() if idx is not None else None, n, count,
                           vocab, t, ids.data_ptr(), lp.data_ptr(),
                           threads.kernel_threads() if n >= PARALLEL_ROWS else 1)
    if rc != 0:
        raise RuntimeError(f"topk_logprobs refused logits {tuple(logits.shape)}, t={t}, rows outside")
    return ids, lp


def topk_logprobs_padded(
    logits: torch.Tensor, t: int, node_rows: np.ndarray, lengths: np.ndarray, traced: np.ndarray
) -> tuple[np.ndarray, np.ndarray] | None:
    """A verify step's trace arrays in one native call: ids [B, K+1, t] int32 and log-probs
    [B, K+1, t] float16, where slot (b, j) holds the top-t of ``logits`` [R, V] row
    ``node_rows[b, j]`` if ``traced[b]`` and j <= ``lengths[b]``, else -1 / -inf. None where the
    native kernel does not apply (another device or dtype, no compiler): the caller then takes
    ``topk_logprobs``."""
    count, vocab = logits.shape
    t = min(t, vocab)
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or not 1 <= t <= MAX_T:
        return None
    lib = native_build.load("topk_logprobs", _declare)
    if lib is None:
        return None
    b, k1 = node_rows.shape
    if np.shape(lengths) != (b,) or np.shape(traced) != (b,):
        raise ValueError(f"lengths {np.shape(lengths)} and traced {np.shape(traced)} must be [{b}] "
                         f"for node_rows {tuple(node_rows.shape)}")
    x = logits.contiguous()
    rows = np.ascontiguousarray(node_rows, dtype=np.int64)
    lens = np.ascontiguousarray(lengths, dtype=np.int64)
    flags = np.ascontiguousarray(traced, dtype=np.uint8)
    ids = np.empty((b, k1, t), dtype=np.int32)
    lp = np.empty((b, k1, t), dtype=np.float16)
    n = lib.topk_logprobs_padded(x.data_ptr(), count, vocab, rows.ctypes.data, lens.ctypes.data,
                                 flags.ctypes.data, b, k1, t, ids.ctypes.data, lp.ctypes.data,
                                 threads.kernel_threads(), PARALLEL_ROWS)
    if n < 0:
        raise RuntimeError(f"topk_logprobs_padded refused logits {tuple(logits.shape)}, t={t}: "
                           "a traced position's row is outside them")
    return ids, lp
