"""Sample-and-match verification with position-keyed randomness.

For a sampled request (temperature > 0) whose drafts are point masses (model-free or argmax
drafters: ``DraftProposal.dists is None``), the engine samples the target's own token y_j at every
verified position j and accepts the longest prefix of drafts equal to y. The emitted tokens are
exactly the target's sequential samples, so this is lossless; its acceptance probability for a
draft x is p(x), the same as rejection sampling with q = point mass.

The uniform behind y_j comes from a counter-based hash of (request seed, output position), not a
stream: a seeded request then produces the same tokens whatever else is in the batch, whatever the
drafter proposed, across drafter swaps, and with speculation off (k = 0).
"""

from __future__ import annotations

import numpy as np
import torch

from kernels.sampling import sample_from_uniform
from kernels.verify import VerifyResult

_MASK64 = (1 << 64) - 1


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def position_uniforms(seeds: list[int], positions: np.ndarray) -> np.ndarray:
    """[n, m] float64 uniforms in [0, 1) for row seeds [n] and output positions [n, m]."""
    key = _splitmix64(np.array([s & _MASK64 for s in seeds], dtype=np.uint64))  # [n]
    pos = _splitmix64(np.asarray(positions, dtype=np.uint64) + np.uint64(1))  # [n, m]
    bits = _splitmix64(key[:, None] ^ pos)  # [n, m]
    return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def match_verify(
    draft_tokens: torch.Tensor,
    draft_lengths: torch.Tensor,
    target_probs: torch.Tensor,
    seeds: list[int],
    first_positions: list[int],
) -> VerifyResult:
    """``draft_tokens`` [n, k], ``draft_lengths`` [n], ``target_probs`` [n, k+1, V] (sampling
    distributions, ``probs_from_logits``), per-row ``seeds`` and output position of verified
    position 0 (``first_positions``)."""
    n, k1, vocab = target_probs.shape
    positions = np.asarray(first_positions, dtype=np.int64)[:, None] + np.arange(k1)  # [n, k+1]
    u = torch.from_numpy(position_uniforms(seeds, positions)).to(target_probs.device)  # [n, k+1]
    y = sample_from_uniform(target_probs.reshape(n * k1, vocab), u.reshape(-1)).view(
        n, k1
    )  # [n, k+1]
    k = k1 - 1
    in_len = torch.arange(k, device=y.device) < draft_lengths.to(y.device)[:, None]  # [n, k]
    match = (y[:, :k] == draft_tokens.to(y.device)) & in_len  # [n, k]
    num_accepted = match.long().cumprod(dim=1).sum(dim=1)  # [n]
    next_tokens = y.gather(1, num_accepted[:, None]).squeeze(1)  # [n]
    return VerifyResult(num_accepted=num_accepted, next_tokens=next_tokens)
