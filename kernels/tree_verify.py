"""Token-tree verify: accept the longest drafted path the target agrees with, in one forward.

A row's tree has N nodes. Node 0 is the root (the row's last committed token, the first input of
the step); nodes 1..N-1 are drafted tokens with ``parents[b, i] < i`` (-1 for the root and for
padding nodes, which are never accepted). The target scored every node in one forward under a tree
attention mask (each node sees the committed prefix, its ancestors and itself), so ``logits[b, i]``
is the target's distribution for the token after the path root..i. A chain of k drafts is the tree
``parents = [-1, 0, 1, ..., k-1]``.

Acceptance is a walk from the root: at node i the target's token y_i (argmax under greedy; a sample
under sampling) is compared with i's children; the child that drafted y_i is accepted and the walk
moves there, else the step ends and y_i is the next (bonus/correction) token. The emitted tokens
are exactly y along the path, so when y_i at depth d is the sample the target would draw at output
position ``first + d`` (position-keyed uniforms, serving/engine/seeded.py), the output is the
target's own sequential sample: lossless for point-mass drafts whatever the tree is. Drafts with
distributions use the chain rejection sampler (kernels/verify.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from kernels.argmax_rows import native_lib
from kernels.sampling import sample_from_uniform
from kernels.threads import kernel_threads


@dataclass
class TreeVerifyResult:
    num_accepted: Tensor  # [B] int64: accepted drafted nodes (path length without the root)
    next_tokens: Tensor  # [B] int64: the target's token after the accepted path
    path: Tensor  # [B, N] int64: node indices root, accepted nodes..., then -1


def chain_parents(lengths: Tensor, n: int) -> Tensor:
    """[B] draft lengths -> [B, n] parents of a chain (node i's parent is i - 1; -1 beyond)."""
    idx = torch.arange(n, device=lengths.device)  # [n]
    parents = (idx - 1).expand(lengths.shape[0], n).clone()  # [B, n]
    parents[idx[None, :].expand_as(parents) > lengths[:, None]] = -1
    return parents


def tree_depths(parents: Tensor) -> Tensor:
    """[B, N] parents -> [B, N] int64 depth (root 0; padding nodes count as children of the root).
    On the CPU over lists: the tensor loop's ~4 ops a node took ~0.1 ms for 9 nodes (hot caches;
    several times that on a step thread's, after a forward)."""
    if parents.device.type == "cpu":
        b, n = parents.shape
        depth = []
        for row in parents.tolist():
            d = [0] * n
            for i in range(1, n):
                d[i] = d[max(row[i], 0)] + 1
            depth.append(d)
        return torch.from_numpy(np.array(depth, dtype=np.int64).reshape(b, n))  # not torch.tensor: ~2x
    return _tree_depths_tensors(parents)


def _tree_depths_tensors(parents: Tensor) -> Tensor:
    b, n = parents.shape
    par = parents.clamp(min=0)
    depth = torch.zeros(b, n, dtype=torch.long, device=parents.device)
    for i in range(1, n):
        depth[:, i] = depth.gather(1, par[:, i : i + 1]).squeeze(1) + 1
    return depth


def tree_ancestors(parents: Tensor) -> Tensor:
    """[B, N] parents -> [B, N, N] bool: ``anc[b, i, j]`` iff j is i or one of its ancestors. On
    the CPU in numpy (the same recurrence; torch's ops on these few elements cost ~10x)."""
    if parents.device.type == "cpu":
        b, n = parents.shape
        par = np.maximum(parents.numpy(), 0)
        anc = np.broadcast_to(np.eye(n, dtype=bool), (b, n, n)).copy()  # [B, N, N]
        rows = np.arange(b)
        for i in range(1, n):
            anc[:, i] |= anc[rows, par[:, i]]
        return torch.from_numpy(anc)
    return _tree_ancestors_tensors(parents)


def _tree_ancestors_tensors(parents: Tensor) -> Tensor:
    b, n = parents.shape
    par = parents.clamp(min=0)
    anc = torch.eye(n, dtype=torch.bool, device=parents.device).expand(b, n, n).clone()
    rows = torch.arange(b, device=parents.device)
    for i in range(1, n):
        anc[:, i] |= anc[rows, par[:, i]]  # parent's ancestors (parents[i] < i: already final)
    return anc


def tree_accept(tokens: Tensor, parents: Tensor, target_tokens: Tensor) -> TreeVerifyResult:
    """Walk from the root following ``target_tokens`` [B, N] (the target's token at each node).

    ``tokens`` [B, N] node tokens (node 0's is ignored), ``parents`` [B, N]. On the CPU the walk
    runs over Python lists (``_tree_accept_lists``): ~8 torch ops per level on tensors of a few
    elements took ~0.2 ms a step at batch 1, ~1 % of it; elsewhere it stays on the device."""
    if tokens.device.type == "cpu":
        return _tree_accept_lists(tokens, parents, target_tokens)
    return _tree_accept_tensors(tokens, parents, target_tokens)


def _tree_accept_tensors(tokens: Tensor, parents: Tensor, target_tokens: Tensor) -> TreeVerifyResult:
    """``tree_accept`` on the device: one level of every row per iteration."""
    b, n = tokens.shape
    device = tokens.device
    rows = torch.arange(b, device=device)
    cur = torch.zeros(b, dtype=torch.long, device=device)  # [B] current node
    live = torch.ones(b, dtype=torch.bool, device=device)
    path = torch.full((b, n), -1, dtype=torch.long, device=device)
    path[:, 0] = 0
    num = torch.zeros(b, dtype=torch.long, device=device)
    for _ in range(n - 1):
        want = target_tokens[rows, cur]  # [B]
        child = (parents == cur[:, None]) & (tokens == want[:, None])  # [B, N]
        child[:, 0] = False
        has = child.any(dim=1) & live  # [B]
        if not bool(has.any()):
            break
        nxt = child.int().argmax(dim=1)  # [B] first matching child
        cur = torch.where(has, nxt, cur)
        num = num + has.long()
        path[rows[has], num[has]] = cur[has]
        live = has
    return TreeVerifyResult(num, target_tokens[rows, cur], path)


def _tree_accept_lists(tokens: Tensor, parents: Tensor, target_tokens: Tensor) -> TreeVerifyResult:
    """``tree_accept`` on the CPU: the same walk (the first child that drafted the target's token),
    row by row over lists."""
    b, n = tokens.shape
    tok, par, tgt = tokens.tolist(), parents.tolist(), target_tokens.tolist()
    path = [[-1] * n for _ in range(b)]
    num, nxt = [0] * b, [0] * b
    for r in range(b):
        tr, pr, yr, walk = tok[r], par[r], tgt[r], path[r]
        cur = walk[0] = 0
        depth = 0
        while True:
            want = yr[cur]
            child = next((i for i in range(1, n) if pr[i] == cur and tr[i] == want), 0)
            if not child:
                break
            cur = child
            depth += 1
            walk[depth] = cur
        num[r], nxt[r] = depth, yr[cur]
    return TreeVerifyResult(
        torch.tensor(num, dtype=torch.long), torch.tensor(nxt, dtype=torch.long),
        torch.tensor(path, dtype=torch.long).view(b, n),
    )


def greedy_tree_walk(logits: Tensor, node_row: Tensor, drafts: Tensor, parents: Tensor) -> TreeVerifyResult | None:
    """The greedy verify in one native call (``kernels/native/argmax_rows.c``, ``tree_walk``):
    ``tree_accept`` following the target's argmax, read at the nodes the walk reaches only
    (accepted + 1 per row).

    ``logits`` [R, V] fp32, ``node_row`` [B, N] each node's row of it (-1 at padding), ``drafts``
    [B, N-1] node i's drafted token at [b, i - 1], ``parents`` [B, N]. Same result as
    ``tree_accept(tokens, parents, argmax of every node's row)``; None where the kernel does not
    apply (off the CPU, other dtypes, no compiler): the caller then computes the targets."""
    return _native_walk(logits, node_row, drafts, parents, None)


def sampled_tree_walk(probs: Tensor, drafts: Tensor, parents: Tensor, uniforms: Tensor) -> TreeVerifyResult | None:
    """``sampled_tree_verify`` in one native call: the target's sample (``sample_from_uniform``, the
    same running sum in double precision, so the same token) drawn at the nodes the walk reaches
    only. ``probs`` [B, N, V] fp32, ``drafts`` [B, N-1], ``parents`` [B, N], ``uniforms`` [B, N].
    None where the kernel does not apply: the caller then samples every node."""
    b, n = parents.shape
    if probs.dim() != 3 or tuple(probs.shape[:2]) != (b, n):
        raise ValueError(f"probs {tuple(probs.shape)} do not fit parents {(b, n)}")
    node_row = torch.arange(b * n, device=probs.device).view(b, n)
    return _native_walk(probs.reshape(b * n, -1), node_row, drafts, parents, uniforms)


def sampled_tree_walk_from_logits(logits: Tensor, node_row: Tensor, drafts: Tensor, parents: Tensor,
                                  temperature: Tensor, uniforms: Tensor) -> TreeVerifyResult | None:
    """``sampled_tree_walk`` for rows sampled at a temperature alone (no top-k, no top-p): the
    softmax of a node's logits / temperature (``probs_from_logits``, with the kernels' vector exp: the
    same distribution to ~2e-7) is computed for the nodes the walk reaches only, not for every
    verified node. ``logits`` [R, V] and ``node_row`` [B, N] as ``greedy_tree_walk`` takes them,
    ``temperature`` [B] (> 0), ``uniforms`` [B, N]. None where the kernel does not apply."""
    b = parents.shape[0]
    temp = temperature.to(torch.float32).contiguous()
    if tuple(temp.shape) != (b,) or not bool((temp > 0).all()):
        raise ValueError(f"temperature must be [{b}] and positive, got {temp.tolist()}")
    return _native_walk(logits, node_row, drafts, parents, uniforms, temp)


def _native_walk(x: Tensor, node_row: Tensor, drafts: Tensor, parents: Tensor,
                 uniforms: Tensor | None, temperature: Tensor | None = None) -> TreeVerifyResult | None:
    if x.device.type != "cpu" or x.dtype != torch.float32 or not x.is_contiguous():
        return None
    lib = native_lib()
    if lib is None:
        return None
    b, n = parents.shape
    node_row, parents = node_row.to(torch.long).contiguous(), parents.to(torch.long).contiguous()
    drafts = drafts.to(torch.long).contiguous()
    if tuple(node_row.shape) != (b, n) or tuple(drafts.shape) != (b, n - 1):
        raise ValueError(f"node_row {tuple(node_row.shape)} and drafts {tuple(drafts.shape)} do not fit "
                         f"parents {(b, n)}")
    u = None
    if uniforms is not None:
        u = uniforms.to(torch.float64).contiguous()
        if tuple(u.shape) != (b, n):
            raise ValueError(f"uniforms {tuple(u.shape)} do not fit parents {(b, n)}")
    out = torch.empty(b * (2 + n), dtype=torch.long, device="cpu")  # num [B], next [B], path [B, N]: one allocation
    num, nxt, path = out[:b], out[b : 2 * b], out[2 * b :].view(b, n)
    threads = min(kernel_threads(), b // 2) or 1  # a worker per row walk; not woken for one or two
    rc = lib.tree_walk(x.data_ptr(), node_row.data_ptr(), drafts.data_ptr(), parents.data_ptr(),
                       None if u is None else u.data_ptr(),
                       None if temperature is None else temperature.data_ptr(), num.data_ptr(),
                       nxt.data_ptr(), path.data_ptr(), x.shape[0], x.shape[1], b, n, threads)
    if rc != 0:
        raise ValueError("tree_walk reached a node without a row (or could not allocate its scratch row)")
    return TreeVerifyResult(num, nxt, path)


def greedy_tree_verify(tokens: Tensor, parents: Tensor, target_logits: Tensor) -> TreeVerifyResult:
    """Greedy: follow the target's argmax. ``target_logits`` [B, N, V]."""
    return tree_accept(tokens, parents, target_logits.argmax(dim=-1))


def sampled_tree_verify(
    tokens: Tensor, parents: Tensor, target_probs: Tensor, uniforms: Tensor
) -> TreeVerifyResult:
    """Sample-and-match for point-mass drafts: ``target_probs`` [B, N, V] sampling distributions,
    ``uniforms`` [B, N] the uniform behind each node's target sample (for losslessness, the uniform
    of the output position the node's token would take: same depth, same uniform)."""
    b, n, vocab = target_probs.shape
    y = sample_from_uniform(target_probs.reshape(b * n, vocab), uniforms.reshape(-1)).view(b, n)
    return tree_accept(tokens, parents, y)
