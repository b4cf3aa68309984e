"""Pack a trace's discarded branches onto its main sequence, as a token tree, for one forward pass.

A branch example is ``prompt + output[:pos] + drafts``: all but its last few tokens repeat the main
sequence. Run separately, every branch re-encodes the whole prompt, so a trace with 40 rejecting
steps costs 40 prompt-length forwards. Packed, the branch contributes only its *tail* (the tokens
after its longest common prefix with the main sequence), appended after the main tokens with

- position ids continuing from the shared prefix (``lcp, lcp+1, ...``), and
- an attention mask letting each tail token see the main tokens of the shared prefix and the
  earlier tokens of its own tail, nothing else,

which gives every tail token exactly the context it had as a separate sequence, so its logits are
the same (tested against unpacked forwards). Branch rows always read logits inside the tail: a
branch's first row predicts the token after the rejected draft, which differs from the output.

Examples that share no main sequence in the batch (or were truncated so the prefix no longer
lines up) become sequences of their own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from trainer.examples import SequenceExample


@dataclass
class PackedSequence:
    tokens: np.ndarray  # [L] int64
    positions: np.ndarray  # [L] int64
    sees_main: np.ndarray  # [L] int64: how many main tokens (a prefix) each token attends to
    branch: np.ndarray  # [L] int64: -1 for main tokens, else the tail (branch) id
    main_len: int
    rows: list[np.ndarray]
    """Per packed example (in ``examples`` order): [rows] index of the token whose logits the row reads."""
    examples: list[SequenceExample]


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.nonzero(a[:n] != b[:n])[0]
    return int(diff[0]) if len(diff) else n


def _alone(ex: SequenceExample) -> PackedSequence:
    L = len(ex.tokens)
    return PackedSequence(
        tokens=ex.tokens, positions=np.arange(L), sees_main=np.arange(1, L + 1),
        branch=np.full(L, -1), main_len=L, rows=[ex.ctx_len - 1], examples=[ex],
    )


def pack_examples(examples: list[SequenceExample]) -> list[PackedSequence]:
    """Group each main example with the branches of the same request whose tail lines up."""
    mains: dict[str, PackedSequence] = {}
    out: list[PackedSequence] = []
    for ex in examples:
        if not ex.discard and ex.request_id not in mains:
            mains[ex.request_id] = seq = _alone(ex)
            out.append(seq)
    for ex in examples:
        seq = mains.get(ex.request_id)
        if not ex.discard and seq is not None and seq.examples[0] is ex:
            continue
        if seq is None or not ex.discard:
            out.append(_alone(ex))
            continue
        main = seq.examples[0]
        lcp = _common_prefix(main.tokens, ex.tokens)
        if lcp == 0 or int(ex.ctx_len.min()) - 1 < lcp:
            out.append(_alone(ex))  # a row would read inside the shared prefix: keep it separate
            continue
        tail = ex.tokens[lcp:]
        start = len(seq.tokens)
        b = len(seq.examples)
        seq.tokens = np.concatenate([seq.tokens, tail])
        seq.positions = np.concatenate([seq.positions, lcp + np.arange(len(tail))])
        seq.sees_main = np.concatenate([seq.sees_main, np.full(len(tail), lcp)])
        seq.branch = np.concatenate([seq.branch, np.full(len(tail), b)])
        seq.rows.append(start + (ex.ctx_len - 1 - lcp))
        seq.examples.append(ex)
    return out


def batch_tensors(seqs: list[PackedSequence]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``(input_ids [B, L], position_ids [B, L], mask [B, 1, L, L] bool)``, on the CPU
    (a student moves them to its device).

    Padding tokens attend only to themselves (no row reads them; a fully masked row would be NaN).
    """
    L = max(len(s.tokens) for s in seqs)
    B = len(seqs)
    ids = torch.zeros(B, L, dtype=torch.long, device="cpu")
    pos = torch.zeros(B, L, dtype=torch.long, device="cpu")
    mask = torch.eye(L, dtype=torch.bool, device="cpu").repeat(B, 1, 1)  # [B, L, L]
    for b, s in enumerate(seqs):
        n = len(s.tokens)
        ids[b, :n] = torch.from_numpy(s.tokens)
        pos[b, :n] = torch.from_numpy(s.positions)
        br = torch.from_numpy(s.branch)  # [n]
        key = torch.arange(n, device="cpu")
        sees = torch.from_numpy(s.sees_main)  # [n]
        on_main = (key[None, :] < s.main_len) & (key[None, :] < sees[:, None])  # [n, n]
        own_tail = (br[:, None] >= 0) & (br[None, :] == br[:, None]) & (key[None, :] <= key[:, None])
        mask[b, :n, :n] = on_main | own_tail
    return ids, pos, mask[:, None]
