"""topk_logprobs: the ``t`` largest logits of each row and their log-probabilities, as traces
record the target's top-k at every verified position.

The torch reference reads each row three times (topk, logsumexp, and a gather before them); the
native kernel (``kernels/native/topk_logprobs.c``) reads it once and once more from cache: ~4x
less time for a 4 x 5-position verify step on this CPU. Ids come back in descending order of
logit; log-probs agree with the reference to ~1e-6.
"""

from __future__ import annotations

import ctypes

import torch

from kernels import native_build, threads

MAX_T = 64


def _declare(lib: ctypes.CDLL) -> None:
    lib.topk_logprobs.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_int,
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
    ]
    lib.topk_logprobs.restype = ctypes.c_int


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
    ids = torch.empty(n, t, dtype=torch.long)
    lp = torch.empty(n, t, dtype=torch.float32)
    rc = lib.topk_logprobs(x.data_ptr(), idx.data_ptr() if idx is not None else None, n, count,
                           vocab, t, ids.data_ptr(), lp.data_ptr(), threads.kernel_threads())
    if rc != 0:
        raise RuntimeError(f"topk_logprobs refused logits {tuple(logits.shape)}, t={t}, rows outside")
    return ids, lp
