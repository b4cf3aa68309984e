"""Sample-and-match verification with position-keyed randomness.

For a sampled request (temperature > 0) whose drafts are point masses (model-free or argmax
drafters: ``DraftProposal.dists is None``), the engine samples the target's own token y_j at every
verified position j and accepts the longest prefix of drafts equal to y (for token trees: the
branch that follows y, each node sampled with the uniform of its output position;
kernels/tree_verify.py). The emitted tokens are exactly the target's sequential samples, so this
is lossless; its acceptance probability for a draft x is p(x), the same as rejection sampling with
q = point mass.

The uniform behind y_j comes from a counter-based hash of (request seed, output position), not a
stream: a seeded request then produces the same tokens whatever else is in the batch, whatever the
drafter proposed, across drafter swaps, and with speculation off (k = 0).
"""

from __future__ import annotations

import numpy as np

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
