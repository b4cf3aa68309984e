"""Synthetic tensors shaped like SGLang 0.5.23's eagle_sample inputs and outputs.

A tree is given as parent lists per request (node 0 = root, the last committed token). The
greedy reference below follows the documented semantics of SGLang's tree verify -- from the
current node, try its children (first child, then siblings) for the target's argmax; stop at
the first miss -- and returns eagle_sample's (predict, accept_lens, accept_index) layout:
global node ids ``b * N + local``, -1 padded, accept_lens = accepted drafts + 1.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch


def tree_links(parents: list[int]) -> tuple[list[int], list[int]]:
    """(first_child, next_sibling) local indices from a parent list (parents[0] = -1)."""
    n = len(parents)
    first_child, next_sibling = [-1] * n, [-1] * n
    for node in range(n - 1, 0, -1):  # later nodes become later siblings
        p = parents[node]
        next_sibling[node] = first_child[p]
        first_child[p] = node
    return first_child, next_sibling


def make_verify_step(tokens: list[list[int]], parents: list[int], logits: torch.Tensor,
                     seq_lens: list[int], topk: int, depth: int, draft_probs=None):
    """Build (verify_input, batch, logits_output) and the greedy eagle_sample result.

    tokens: [B][N] tree tokens; logits: [B, N, V]; depth: spec steps (accept_index width - 1).
    """
    b, n = len(tokens), len(parents)
    first_child, next_sibling = tree_links(parents)
    draft_token = torch.tensor(tokens, dtype=torch.int64).reshape(-1)  # [B*N]
    node_depth = [0] * n
    for node in range(1, n):
        node_depth[node] = node_depth[parents[node]] + 1
    positions = torch.tensor([[s + d for d in node_depth] for s in seq_lens]).reshape(-1)
    verify_input = SimpleNamespace(
        draft_token=draft_token,
        retrieve_next_token=torch.tensor([first_child] * b, dtype=torch.int64),
        retrieve_next_sibling=torch.tensor([next_sibling] * b, dtype=torch.int64),
        retrieve_index=torch.arange(b * n, dtype=torch.int64).reshape(b, n),
        positions=positions,
        draft_token_num=n,
        topk=topk,
        spec_steps=depth,
        draft_probs=draft_probs,
    )
    argmax = logits.argmax(-1)  # [B, N]
    predict = torch.zeros(b * n, dtype=torch.int32)
    accept_index = torch.full((b, depth + 1), -1, dtype=torch.int32)
    accept_lens = torch.zeros(b, dtype=torch.int32)
    for r in range(b):
        path, cur = [0], 0
        while True:
            want, child = int(argmax[r, cur]), first_child[cur]
            while child != -1 and tokens[r][child] != want:
                child = next_sibling[child]
            if child == -1:
                break
            path.append(child)
            cur = child
        for j, node in enumerate(path):
            accept_index[r, j] = r * n + node
            predict[r * n + node] = int(argmax[r, node])
        accept_lens[r] = len(path)
    batch = SimpleNamespace(
        reqs=[SimpleNamespace(rid=f"req-{r}", origin_input_ids=list(range(seq_lens[r] - 1)))
              for r in range(b)],
        forward_mode=SimpleNamespace(is_idle=lambda: False),
    )
    logits_output = SimpleNamespace(next_token_logits=logits.reshape(b * n, -1).clone())
    return verify_input, batch, logits_output, (predict, accept_lens, accept_index)


def logits_preferring(targets: list[list[int]], vocab: int, seed: int = 0) -> torch.Tensor:
    """[B, N, V] random logits whose argmax at node j of request r is targets[r][j]."""
    g = torch.Generator().manual_seed(seed)
    b, n = len(targets), len(targets[0])
    logits = torch.randn(b, n, vocab, generator=g)
    for r in range(b):
        for j in range(n):
            logits[r, j, targets[r][j]] = logits[r, j].max() + 2.0
    return logits
