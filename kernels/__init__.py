"""specloop kernels: pure-torch reference numerics for sampling, speculative verify and
distillation losses. Imports no other specloop package; a fused (Triton) version can replace any
function behind the same signature."""

from kernels.losses import (
    discard_loss,
    distill_loss,
    distill_loss_per_position,
    next_token_ce,
    topk_buckets,
)
from kernels.sampling import probs_from_logits, sample
from kernels.tree_verify import (
    TreeVerifyResult,
    greedy_tree_verify,
    sampled_tree_verify,
    tree_accept,
    tree_ancestors,
    tree_depths,
)
from kernels.verify import (
    VerifyResult,
    expected_acceptance,
    greedy_verify,
    rejection_verify,
    verify,
)

__all__ = [
    "TreeVerifyResult",
    "VerifyResult",
    "discard_loss",
    "distill_loss",
    "distill_loss_per_position",
    "expected_acceptance",
    "greedy_tree_verify",
    "greedy_verify",
    "next_token_ce",
    "probs_from_logits",
    "rejection_verify",
    "sample",
    "sampled_tree_verify",
    "topk_buckets",
    "tree_accept",
    "tree_ancestors",
    "tree_depths",
    "verify",
]
