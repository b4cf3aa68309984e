"""RaggedKVCache with token trees: tree logits equal the logits of each node's own path, and
after commit_paths the cache holds exactly the accepted path (next forward equals an unpadded run)."""

from __future__ import annotations

import pytest
import torch

from kernels.tree_verify import tree_ancestors, tree_depths
from serving.engine.batch_cache import RaggedKVCache
from serving.target import tiny_target


def _path(tokens, parents, i):
    out = []
    while i > 0:
        out.append(tokens[i])
        i = parents[i]
    return list(reversed(out))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4)])
def test_tree_forward_and_path_compaction(dtype, tol):
    model = tiny_target(vocab_size=97, dtype=dtype, seed=3).model
    g = torch.Generator().manual_seed(0)
    prefixes = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (6, 1, 13)]
    roots = [5, 17, 33]
    # row trees: node 0 = root; parents < own index; row 1 is a chain, row 2 pads its last node
    trees = [
        ([roots[0], 10, 11, 12, 13, 14], [-1, 0, 0, 1, 1, 4]),
        ([roots[1], 20, 21, 22, 23, 24], [-1, 0, 1, 2, 3, 4]),
        ([roots[2], 30, 31, 32, 34, 0], [-1, 0, 1, 0, 3, -1]),
    ]
    accepted = [[0, 1, 4, 5], [0, 1, 2], [0, 3]]  # node paths kept per row
    with torch.inference_mode():
        cache = RaggedKVCache.for_model(model)
        for pre in prefixes:
            row = RaggedKVCache.for_model(model, batch_size=1)
            pos, mask = row.prepare(len(pre))
            model(torch.tensor([pre]), position_ids=pos, attention_mask=mask, past_key_values=row)
            row.commit([len(pre)])
            cache.append(row)
        tokens = torch.tensor([t for t, _ in trees])  # [B, N]
        parents = torch.tensor([p for _, p in trees])  # [B, N]
        cache.set_tree(tree_depths(parents), tree_ancestors(parents))
        pos, mask = cache.prepare(tokens.shape[1])
        logits = model(tokens, position_ids=pos, attention_mask=mask, past_key_values=cache).logits
        for b, (tok, par) in enumerate(trees):
            for i in range(len(tok)):
                if i > 0 and par[i] < 0:
                    continue  # padding node
                seq = prefixes[b] + [tok[0]] + _path(tok, par, i)
                ref = model(torch.tensor([seq])).logits[0, -1]
                assert (logits[b, i] - ref).abs().max().item() < tol, (b, i)
        cache.commit_paths(accepted)
        assert cache.lengths == [len(p) + len(a) for p, a in zip(prefixes, accepted)]
        nxt = torch.tensor([[3], [4], [5]])
        pos, mask = cache.prepare(1)
        out = model(nxt, position_ids=pos, attention_mask=mask, past_key_values=cache).logits
        cache.commit([1, 1, 1])
        for b, (tok, _) in enumerate(trees):
            seq = prefixes[b] + [tok[n] for n in accepted[b]] + [int(nxt[b, 0])]
            ref = model(torch.tensor([seq])).logits[0, -1]
            assert (out[b, 0] - ref).abs().max().item() < tol, b
