"""The EAGLE student: an EagleHead (feedback/drafters/eagle_head.py) trained on the target features
that traces carry, with a training-time test (EAGLE-3 style chain simulation).

Pairing (as the serving drafter): pair j = (f_j, x_{j+1}) predicts x_{j+2}, so the trace row with
context length c (predicting x_c) is read at pair j = c - 2. The trace's ``hidden_states`` row t is
f_t (features of positions 0..N-2: the last output token never went through the target).

Chain depth d >= 1 re-runs the head at every pair on its *own* previous output hidden state (not the
target's feature) and the next token, predicting x_{j+2+d}; its queries attend to the real
(depth-0) keys up to j and to their own keys at earlier depths only, exactly what a serving draft
step at position j+d sees. Tokens fed at depth d are the true ones: while the chain is accepted they
equal the head's own greedy tokens, and after the first miss nothing more counts, so ``evaluate``
gets each position's exact greedy accepted length from one depth-k pass.

The draft vocabulary is the head's (``draft_to_target`` / ``target_to_draft``); choose it from
traffic with ``traffic_frequencies`` + ``feedback.drafters.vocab.day0_draft_vocab``. Target top-k
entries outside it are ignored by the losses (the head can never propose them).
"""

from __future__ import annotations

import numpy as np
import torch

from feedback.bus.trace import TraceRecord
from trainer.examples import SequenceExample, bf16_bits_to_float32, build_examples, stack_topk
from trainer.students import RecordEval, RowBatch, Student, to_device, top_candidates, topk_overlap


def traffic_frequencies(records: list[TraceRecord], vocab_size: int, prompt_weight: float = 0.25) -> np.ndarray:
    """[V] token counts of the traces' outputs (+ ``prompt_weight`` x prompt tokens)."""
    freq = np.zeros(vocab_size, dtype=np.float64)
    for r in records:
        freq += np.bincount(np.asarray(r.output_ids, dtype=np.int64), minlength=vocab_size)[:vocab_size]
        freq += prompt_weight * np.bincount(np.asarray(r.prompt_ids, dtype=np.int64), minlength=vocab_size)[:vocab_size]
    return freq


class _StackedKV:
    """Cache for the chain: each depth appends its keys/values after the earlier depths'."""

    def __init__(self):
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def update(self, key, value, layer_idx, *args, **kwargs):
        self.keys.append(key)
        self.values.append(value)
        return torch.cat(self.keys, dim=2), torch.cat(self.values, dim=2)  # [B, kvh, n*(d+1), hd]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


def chain_mask(n: int, depth: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[1, n, n*(depth+1)] bool: causal over the real keys, then the diagonal of each earlier depth."""
    blocks = [torch.ones(n, n, dtype=torch.bool, device=device).tril()]
    blocks += [torch.eye(n, dtype=torch.bool, device=device)] * depth
    return torch.cat(blocks, dim=1)[None]


def chain_hidden(head, tokens: torch.Tensor, feats: torch.Tensor, depth: int) -> list[torch.Tensor]:
    """Head outputs at every pair for depths 0..depth-1.

    tokens [B, n + depth] (x_1, x_2, ...: pair j reads tokens[:, j + d] at depth d), feats [B, n, F]
    -> ``depth`` tensors [B, n, H].
    """
    b, n = feats.shape[:2]
    dev = feats.device
    cache = _StackedKV()
    outs: list[torch.Tensor] = []
    hidden = None
    for d in range(depth):
        pos = (torch.arange(n, device=dev) + d).expand(b, n)  # [B, n]
        ids = tokens[:, d : d + n]  # [B, n]
        if d == 0:
            hidden = head(ids, features=feats, position_ids=pos, cache=cache, attn_mask=chain_mask(n, 0, dev))
        else:
            hidden = head(ids, hidden, position_ids=pos, cache=cache, attn_mask=chain_mask(n, d, dev))
        outs.append(hidden)  # [B, n, H]
    return outs


class EagleStudent(Student):
    kind = "eagle"

    def __init__(self, head, depth: int = 3, depth_decay: float = 0.8, max_len: int = 512):
        """``head``: an EagleHead with the target's embeddings attached (trained in fp32)."""
        self.model = head.float()
        self.depth = depth
        self.depth_decay = depth_decay
        self.max_len = max_len

    @property
    def draft_to_target(self) -> torch.Tensor:
        return self.model.draft_to_target

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return tuple(self.model.config.feature_layers)

    def to_draft_ids(self, ids: torch.Tensor) -> torch.Tensor:
        t2d = self.model.target_to_draft.to(ids.device)  # [V]
        inside = (ids >= 0) & (ids < len(t2d))
        out = torch.full_like(ids, -1)
        out[inside] = t2d[ids[inside]]
        return out

    def usable(self, record: TraceRecord) -> bool:
        """The trace carries features of this head's layers."""
        return (record.hidden_states is not None and tuple(record.hidden_layers) == self.feature_layers
                and record.hidden_states.shape[1] == self.model.config.feature_size)

    def _inputs(self, examples: list[SequenceExample], depth: int):
        """Right-padded tokens [B, n + depth] and features [B, n, F] on the head's device; n = longest
        pair count."""
        ns = [len(e.tokens) - 1 for e in examples]
        n = max(ns)
        F = self.model.config.feature_size
        tokens = torch.zeros(len(examples), n + depth, dtype=torch.long, device="cpu")  # [B, n+depth]
        feats = torch.zeros(len(examples), n, F, device="cpu")  # [B, n, F]
        for b, e in enumerate(examples):
            tokens[b, : ns[b]] = torch.from_numpy(e.tokens[1:])
            f = bf16_bits_to_float32(e.features[: ns[b]])  # [n_b, F]
            feats[b, : len(f)] = torch.from_numpy(f)
        return tokens.to(self.device), feats.to(self.device), ns

    def row_batch(self, examples: list[SequenceExample]) -> RowBatch:
        """Accepted-path rows at every chain depth (discard branches have no target features)."""
        examples = [e for e in examples if not e.discard and e.features is not None
                    and e.features.shape[1] == self.model.config.feature_size]
        if not examples:
            raise ValueError("eagle student: no examples with matching target features")
        tokens, feats, ns = self._inputs(examples, self.depth)
        outs = chain_hidden(self.model, tokens, feats, self.depth)
        logits, ids, lps, rej, w = [], [], [], [], []
        for d, hidden in enumerate(outs):
            for b, e in enumerate(examples):
                j = e.ctx_len - 2 - d  # [M] pair index read for each row
                keep = (j >= 0) & (j < ns[b])
                if not keep.any():
                    continue
                logits.append(self.model.compute_logits(hidden[b, torch.from_numpy(j[keep]).to(hidden.device)]))  # [m, Vd]
                ids.append(e.topk_ids[keep])
                lps.append(e.topk_logprobs[keep])
                rej.append(e.rejected_ids[keep])
                w.append(e.weights[keep] * self.depth_decay**d)
        dev = self.device
        return RowBatch(
            logits=torch.cat(logits),  # [N, Vd]
            topk_ids=self.to_draft_ids(to_device(stack_topk(ids, -1), dev)),
            topk_logprobs=to_device(stack_topk(lps, -np.inf), dev),
            rejected_ids=self.to_draft_ids(to_device(np.concatenate(rej), dev)),
            weights=to_device(np.concatenate(w).astype(np.float32), dev),
            discard=torch.zeros(sum(len(x) for x in w), dtype=torch.bool, device=dev),
        )

    @torch.no_grad()
    def evaluate(self, record: TraceRecord, k: int, branches: int = 1) -> RecordEval:
        """As StandaloneStudent.evaluate: the accepted tokens of the greedy k-chain from each
        output position, and with ``branches`` > 1 one more where the chain was refused and the
        target's token was among that position's runners-up. A runner-up is a leaf of serving's
        tree (serving/drafters/draft_tree.py), so it needs no feature chain of its own: its logits
        are the refused position's."""
        main = build_examples(record, include_discard=False, max_len=self.max_len)[0]
        out = np.asarray(record.output_ids, dtype=np.int64)
        if main.features is None:  # no features: the head cannot draft here
            return RecordEval(overlap=np.zeros(main.num_rows), accept_at=np.zeros(len(out), dtype=np.int64))
        tokens, feats, ns = self._inputs([main], k)
        n = ns[0]
        outs = chain_hidden(self.model, tokens, feats, k)
        tops = torch.stack([self.to_target_ids(top_candidates(self.model.compute_logits(h[0]), branches))
                            for h in outs]).cpu()  # [k, n, m]: read element by element below
        preds = tops[..., 0]  # [k, n] the greedy chain
        # overlap at each accepted-path row, from depth 0 (real features)
        j = main.ctx_len - 2  # [R]
        ok = (j >= 0) & (j < n)
        overlap = np.zeros(main.num_rows)
        if ok.any():
            dev = self.device
            q = self.model.compute_logits(outs[0][0, torch.from_numpy(j[ok]).to(dev)]).float().softmax(-1)  # [r, Vd]
            ids = self.to_draft_ids(torch.from_numpy(main.topk_ids[ok]).to(dev))
            overlap[ok] = topk_overlap(q, ids, torch.from_numpy(main.topk_logprobs[ok]).to(dev)).cpu().numpy()
        # greedy chain from output position p: pair j = c - 2 with c the absolute index of x_p
        seq = torch.from_numpy(main.tokens)  # [L]
        L = len(seq)
        cut = len(record.prompt_ids) + len(out) - L
        accept_at = np.zeros(len(out), dtype=np.int64)
        leaf_end = np.zeros(len(out), dtype=bool)
        for p in range(len(out)):
            c = len(record.prompt_ids) + p - cut
            jj = c - 2
            if jj < 0 or jj >= n:
                continue
            a = 0
            while a < k and c + a < L and int(preds[a, jj]) == int(seq[c + a]):
                a += 1
            if tops.shape[-1] > 1 and a < k and c + a < L and bool((tops[a, jj] == seq[c + a]).any()):
                a += 1  # the refused position's runner-up: a leaf, the path ends there refusing nothing
                leaf_end[p] = True
            accept_at[p] = a
        return RecordEval(overlap=overlap, accept_at=accept_at, leaf_end=leaf_end)
