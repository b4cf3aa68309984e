"""Students: the trainer's view of a drafter model (what distil and the gate need from it).

A student turns a batch of SequenceExamples into logits at their rows (for the losses) and scores
one held-out trace (for the gate): the overlap ``sum_x min(p, q)`` at each accepted-path row and the
accepted length of its greedy k-token chain from each output position.

For a causal standalone LM the chain needs no generation: the chain from position p agrees with the
output exactly as long as the teacher-forced argmax agrees at p, p+1, ... (after the first miss
nothing more is accepted), so one forward over prompt + output gives every position's chain.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from feedback.bus.trace import TraceRecord
from trainer.examples import SequenceExample, build_examples, stack_topk
from trainer.frozen_prefix import FrozenPrefixCache, padded
from trainer.packing import PackedSequence, batch_tensors, pack_examples
from trainer.partial_forward import layer_at_rows, llama_layers, run_layers


@dataclass
class RecordEval:
    overlap: np.ndarray  # [R] sum over the target top-k of min(p, q), accepted-path rows
    accept_at: np.ndarray  # [len(output)] accepted tokens of the greedy k-chain (or tree) from each position
    leaf_end: np.ndarray | None = None
    """[len(output)] bool: the accepted path from that position ended on a runner-up, a leaf with
    nothing drafted below it, so its step refused nothing (serving's ``tree_trial``)."""


@dataclass
class RowBatch:
    """Loss inputs for the rows of a batch of examples, in the student's draft vocabulary."""

    logits: torch.Tensor  # [N, Vd]
    topk_ids: torch.Tensor  # [N, T] draft-vocab ids, -1 where padded or outside the draft vocab
    topk_logprobs: torch.Tensor  # [N, T]
    rejected_ids: torch.Tensor  # [N] draft-vocab ids, -1 for none
    weights: torch.Tensor  # [N]
    discard: torch.Tensor  # [N] bool


def run_lengths(match: np.ndarray, cap: int) -> np.ndarray:
    """run[p] = consecutive True from p on, capped at ``cap``."""
    run = np.zeros(len(match) + 1, dtype=np.int64)
    for p in range(len(match) - 1, -1, -1):
        run[p] = run[p + 1] + 1 if match[p] else 0
    return np.minimum(run[:-1], cap)


def tree_runs(match: np.ndarray, in_top: np.ndarray, cap: int) -> tuple[np.ndarray, np.ndarray]:
    """Accepted tokens from each position of a draft whose every level also offers the drafter's
    runners-up (serving/drafters/draft_tree.py): the greedy chain's run (``match``, capped at
    ``cap``), and one more where the first refused position's token was among them (``in_top``);
    a runner-up has no children, so acceptance stops there. Also [n] bool: the path ended on such
    a runner-up (a leaf), so nothing drafted was refused."""
    run = run_lengths(match, cap)  # [n]
    nxt = np.arange(len(run)) + run  # [n] the first position the chain got wrong
    more = (run < cap) & (nxt < len(run))
    more[more] = in_top[nxt[more]]
    return run + more, more


def tree_run_lengths(match: np.ndarray, in_top: np.ndarray, cap: int) -> np.ndarray:
    """``tree_runs``' accepted tokens alone."""
    return tree_runs(match, in_top, cap)[0]


def to_device(a: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """A numpy array as a tensor on ``device`` (shares memory with ``a`` when that is the CPU)."""
    return torch.from_numpy(a).to(device)


def top_candidates(logits: torch.Tensor, branches: int) -> torch.Tensor:
    """[..., Vd] -> [..., m] draft ids, most likely first: the greedy token (m = 1) or a tree
    level's ``branches`` candidates (capped at the vocabulary), as serving drafts them."""
    m = max(1, min(int(branches), logits.shape[-1]))
    return logits.argmax(-1, keepdim=True) if m == 1 else logits.topk(m, dim=-1).indices


def topk_overlap(q: torch.Tensor, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor) -> torch.Tensor:
    """sum_{x in top-k} min(p(x), q(x)); q: [N, V] probs, ids: [N, T] (-1 = absent) -> [N]."""
    valid = topk_ids >= 0  # [N, T]
    qx = torch.gather(q, 1, topk_ids.clamp(min=0)) * valid  # [N, T]
    px = topk_logprobs.float().exp() * valid  # [N, T]
    return torch.minimum(px, qx).sum(-1)  # [N]


class Student:
    """Base: vocabulary mapping between the target's ids and the student's draft vocabulary."""

    kind = "base"
    model: torch.nn.Module
    draft_to_target: torch.Tensor | None = None
    """[Vd] target id of each draft-vocab id, or None when the draft vocabulary is the target's."""

    @property
    def device(self) -> torch.device:
        """Where the model's weights are, so where its forwards run (trainer/device.py)."""
        return next(self.model.parameters()).device

    def to(self, device: torch.device | str) -> Student:
        """Move the model (and the id mappings its forwards index with) to ``device``."""
        self.model.to(device)
        for name in ("draft_to_target", "head_vocab"):
            t = self.__dict__.get(name)
            if isinstance(t, torch.Tensor):
                setattr(self, name, t.to(device))
        self._t2d = self._head_rows = self._head_rows_key = None
        return self

    def _t2d_table(self, vocab_size: int) -> torch.Tensor | None:
        if self.draft_to_target is None:
            return None
        d2t = self.draft_to_target
        table = torch.full((vocab_size,), -1, dtype=torch.long, device=d2t.device)
        table[d2t] = torch.arange(len(d2t), device=d2t.device)
        return table

    def to_draft_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Target ids -> draft ids (-1 stays -1; ids outside the draft vocab become -1), on ``ids``'
        device."""
        if self.draft_to_target is None:
            return ids
        if getattr(self, "_t2d", None) is None:
            self._t2d = self._t2d_table(int(self.draft_to_target.max()) + 1)
        table = self._t2d.to(ids.device)
        inside = (ids >= 0) & (ids < len(table))
        out = torch.full_like(ids, -1)
        out[inside] = table[ids[inside]]
        return out

    def snapshot(self) -> Student:
        """A copy for the gate's champions: its own trainable weights, and the frozen ones (the
        target's tensors, or copies of them that nothing trains) shared with this student instead of
        copied (~140 MB a copy for a SmolLM2 drafter, and the loop keeps several champions)."""
        frozen = [p for p in self.model.parameters() if not p.requires_grad]
        frozen += [t for t in (getattr(self, "_head_rows", None),) if t is not None]  # a frozen head's rows
        return copy.deepcopy(self, {id(t): t for t in frozen})

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """The parameters training changes: what a checkpoint must keep. The frozen ones come back
        with the student itself (the target's tensors, or copies of them made from the target)."""
        return {n: p.detach() for n, p in self.model.named_parameters() if p.requires_grad}

    def load_trainable(self, state: dict[str, torch.Tensor]) -> None:
        """Load the trainable entries of a state dict (a full one or ``trainable_state``'s); a state
        without one of them is refused, nothing loaded."""
        trainable = set(self.trainable_state())
        missing = sorted(trainable - set(state))
        if missing:
            raise ValueError(f"state lacks {len(missing)} trained tensors, e.g. {missing[:3]}")
        self.model.load_state_dict({k: v for k, v in state.items() if k in trainable}, strict=False)

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return ids if self.draft_to_target is None else self.draft_to_target.to(ids.device)[ids]

    def _row_tensors(self, examples: list[SequenceExample], logits: torch.Tensor) -> RowBatch:
        """The rows' targets (from the examples' numpy) beside ``logits``, on its device."""
        dev = logits.device
        cat = lambda name: np.concatenate([getattr(e, name) for e in examples])
        topk_ids = stack_topk([e.topk_ids for e in examples], -1)
        discard = np.concatenate([np.full(e.num_rows, e.discard) for e in examples])
        return RowBatch(
            logits=logits,
            topk_ids=self.to_draft_ids(to_device(topk_ids, dev)),
            topk_logprobs=to_device(stack_topk([e.topk_logprobs for e in examples], -np.inf), dev),
            rejected_ids=self.to_draft_ids(to_device(cat("rejected_ids"), dev)),
            weights=to_device(cat("weights"), dev),
            discard=to_device(discard, dev),
        )


def _logits(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


class StandaloneStudent(Student):
    """A small causal LM over the target's vocabulary (or a draft vocabulary with a mapping).

    ``model(input_ids [B, L]) -> logits [B, L, Vd]`` (a tensor or an object with ``.logits``).
    """

    kind = "standalone"

    def __init__(self, model: torch.nn.Module, max_len: int = 512, draft_to_target: torch.Tensor | None = None,
                 *, head_vocab: torch.Tensor | None = None, train_embeddings: bool = True):
        """``draft_to_target``: the model's own output ids are a draft vocabulary with this mapping.
        ``head_vocab``: [Vd] target ids; a full-vocabulary Hugging Face model is read only at these
        lm_head rows (what serving's StandaloneDrafter does with ``draft_vocab``), which also makes
        the vocabulary projection, the step's dominant cost, Vd/V as expensive.
        ``train_embeddings=False`` freezes the (tied) embeddings and lm_head: a day-0 drafter copies
        them from the target, and their gradient is most of a step's time and optimizer memory."""
        self.model = model
        self.max_len = max_len
        self.head_vocab = None if head_vocab is None else torch.as_tensor(head_vocab, dtype=torch.long)
        if self.head_vocab is not None:
            if draft_to_target is not None:
                raise ValueError("give draft_to_target or head_vocab, not both")
            draft_to_target = self.head_vocab
        self.draft_to_target = draft_to_target
        self.from_target: dict[str, str] = {}
        """{name: digest} of frozen tensors that are the target's (``shared_with_target``, set by
        whoever cut the model from the target): its artifacts leave them to the target."""
        if not train_embeddings:
            for emb in (model.get_input_embeddings(), model.get_output_embeddings()):
                emb.weight.requires_grad_(False)

    def _hf(self) -> bool:
        return hasattr(self.model, "model") and hasattr(self.model, "lm_head")

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] final hidden states -> [..., Vd] logits."""
        w = self.model.lm_head.weight  # [V, H]
        if self.head_vocab is None:
            return F.linear(hidden, w)
        if w.requires_grad:
            return F.linear(hidden, w[self.head_vocab.to(w.device)])
        # a frozen head's draft rows are gathered once (18.9 MB at 8k of 49k rows, every call before)
        key = (w.data_ptr(), w._version)
        if getattr(self, "_head_rows_key", None) != key:
            self._head_rows, self._head_rows_key = w[self.head_vocab.to(w.device)], key  # [Vd, H]
        return F.linear(hidden, self._head_rows)

    def row_batch(self, examples: list[SequenceExample]) -> RowBatch:
        """Logits at every row. Hugging Face causal LMs get the packed path (trainer/packing.py:
        branches as tails of their main sequence, lm_head only at the rows); other modules run
        each example as its own right-padded sequence."""
        if not self._hf():
            if self.head_vocab is not None:
                raise ValueError("head_vocab needs a Hugging Face causal LM (.model and .lm_head)")
            return self._row_batch_unpacked(examples)
        seqs = pack_examples(examples)
        dev = self.device
        ids, pos, mask = (t.to(dev) for t in batch_tensors(seqs))  # [B, L], [B, L], [B, 1, L, L]
        b_idx = torch.cat([torch.full((len(r),), b, device=dev) for b, s in enumerate(seqs) for r in s.rows])  # [N]
        t_idx = torch.from_numpy(np.concatenate([r for s in seqs for r in s.rows])).to(dev)  # [N]
        hidden = self._hidden_at(seqs, ids, pos, mask, b_idx, t_idx)  # [N, H]
        logits = self._head(hidden)  # [N, Vd]: the vocab projection only where read
        return self._row_tensors([ex for s in seqs for ex in s.examples], logits)

    def _hidden_at(self, seqs: list[PackedSequence], ids: torch.Tensor, pos: torch.Tensor | None,
                   mask: torch.Tensor | None, b_idx: torch.Tensor, t_idx: torch.Tensor) -> torch.Tensor:
        """[N, H] final (normed) hidden states of ``seqs`` (batched as ``batch_tensors`` does;
        ``pos`` and ``mask`` None: one plain causal sequence) at the rows ``(b_idx, t_idx)``.

        A Llama model's last layer runs at those rows only (trainer/partial_forward.py); another
        architecture runs its own forward everywhere."""
        inner = self.model.model
        if not llama_layers(inner):
            return inner(input_ids=ids, position_ids=pos, attention_mask=mask).last_hidden_state[b_idx, t_idx]
        if pos is None:  # an evaluation's plain causal sequence: the same as its packed form
            _, pos, mask = (t.to(ids.device) for t in batch_tensors(seqs))
        hidden, first = self._layer_input(seqs, ids)
        *middle, last = inner.layers[first:]
        if middle:
            hidden = run_layers(inner, hidden, pos, mask, middle)
        return inner.norm(layer_at_rows(inner, last, hidden, pos, mask, b_idx, t_idx))  # [N, H]

    def _layer_input(self, seqs: list[PackedSequence], ids: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The input [B, L, H] of the first layer a forward computes, and that layer's index."""
        return self.model.model.embed_tokens(ids), 0

    def _row_batch_unpacked(self, examples: list[SequenceExample]) -> RowBatch:
        L = max(len(e.tokens) for e in examples)
        tokens = torch.zeros(len(examples), L, dtype=torch.long, device="cpu")  # [B, L] right-padded
        for b, e in enumerate(examples):
            tokens[b, : len(e.tokens)] = torch.from_numpy(e.tokens)
        # Causal attention: right padding never reaches a row's context, so no mask is needed.
        logits = _logits(self.model(tokens.to(self.device)))  # [B, L, Vd]
        b_idx = torch.cat([torch.full((e.num_rows,), b, device=logits.device) for b, e in enumerate(examples)])  # [N]
        pos = torch.from_numpy(np.concatenate([e.ctx_len - 1 for e in examples])).to(logits.device)  # [N]
        return self._row_tensors(examples, logits[b_idx, pos])  # [N, Vd]

    @torch.no_grad()
    def evaluate(self, record: TraceRecord, k: int, branches: int = 1) -> RecordEval:
        """Held-out measures of one trace: the expected acceptance at its accepted-path rows, and
        the accepted tokens of the student's greedy k-chain from each output position (with
        ``branches`` > 1: of its tree with that many candidates a position, as serving drafts)."""
        main = build_examples(record, include_discard=False, max_len=self.max_len)[0]
        dev = self.device
        ids = torch.from_numpy(main.tokens)[None].to(dev)  # [1, L]
        cut = len(record.prompt_ids) + len(record.output_ids) - len(main.tokens)  # left-truncated
        out = np.asarray(record.output_ids, dtype=np.int64)
        P = len(record.prompt_ids)
        first = max(0, cut - P + 1)  # output positions whose context survived truncation
        # logits are read from the last prompt token on (each row, each output position's greedy
        # prediction): the vocabulary projection of the prompt's other positions would be thrown away
        lo = first + P - 1 - cut
        if len(main.ctx_len):
            lo = min(lo, int(main.ctx_len.min()) - 1)
        if self._hf():
            t_idx = torch.arange(lo, len(main.tokens), device=dev)
            hidden = self._hidden_at(pack_examples([main]), ids, None, None, torch.zeros_like(t_idx), t_idx)
            logits = self._head(hidden).float()  # [L - lo, Vd]
        else:
            logits = _logits(self.model(ids))[0, lo:].float()  # [L - lo, Vd]
        rows = logits[torch.from_numpy(main.ctx_len - 1 - lo).to(dev)]  # [R, Vd]
        q = rows.softmax(-1)
        ids = self.to_draft_ids(torch.from_numpy(main.topk_ids).to(dev))
        overlap = topk_overlap(q, ids, torch.from_numpy(main.topk_logprobs).to(dev)).cpu().numpy()
        # greedy prediction for every output position p (logit index P + p - 1 - cut, from lo)
        idx = torch.arange(first, len(out), device=dev) + P - 1 - cut - lo
        best = top_candidates(logits[idx], branches)  # [n', m] predicting each output position
        pred = np.full((len(out), best.shape[-1]), -1, dtype=np.int64)
        pred[first:] = self.to_target_ids(best).cpu().numpy()
        in_top = (pred == out[:, None]).any(1)  # [n] (m = 1: the chain's match, which adds nothing)
        accept_at, leaf_end = tree_runs(pred[:, 0] == out, in_top, k)
        return RecordEval(overlap=overlap, accept_at=accept_at, leaf_end=leaf_end)


class SelfSpecStudent(StandaloneStudent):
    """A self-speculative drafter assembled on the target (feedback/drafters/from_target.py): only
    its adapter layers and norm train; the shared target layers, embeddings and lm_head are frozen
    (they are the target's own tensors), and the lm_head is read at the adapter's draft vocabulary."""

    kind = "selfspec"

    def __init__(self, model: torch.nn.Module, config, max_len: int = 512):
        from feedback.drafters.from_target import shared_parameters

        super().__init__(model, max_len, head_vocab=getattr(model, "selfspec_draft_vocab", None),
                         train_embeddings=False)
        self.config = config
        for p in shared_parameters(model, config.exit_layer):
            p.requires_grad_(False)
        self.prefix = FrozenPrefixCache()
        """The shared layers' output per replayed sequence: steps and evaluations run the adapter only."""

    def _layer_input(self, seqs, ids):
        """The shared layers' kept output: a forward computes the adapter's layers only."""
        inner, E = self.model.model, self.config.exit_layer

        def frozen(missing: list[PackedSequence]) -> torch.Tensor:
            m_ids, m_pos, m_mask = (t.to(ids.device) for t in batch_tensors(missing))
            return run_layers(inner, inner.embed_tokens(m_ids), m_pos, m_mask, inner.layers[:E])  # [M, L, H]

        return padded(self.prefix.outputs(seqs, frozen)), E  # [B, L, H]


def selfspec_student_from_artifact(directory, target_model: torch.nn.Module, fingerprint, max_len: int = 512
                                   ) -> SelfSpecStudent:
    """A SelfSpecStudent that starts from a saved adapter (e.g. one pre-trained offline with
    ``specloop train --corpus``) instead of the day-0 copy of a target layer. The artifact is
    validated like any served one (checksums, shapes, the target fingerprint)."""
    from feedback.registry.artifact import DrafterArtifactError, load_drafter

    adapter, meta = load_drafter(directory, fingerprint)
    if meta.kind != "selfspec":
        raise DrafterArtifactError(f"{directory}: a {meta.kind} artifact; a selfspec student needs a selfspec one")
    return selfspec_student_from_adapter(adapter, target_model, max_len)


def selfspec_student_from_adapter(adapter, target_model: torch.nn.Module, max_len: int = 512) -> SelfSpecStudent:
    """A SelfSpecStudent around an adapter ``load_drafter`` already read and checked."""
    from feedback.drafters.from_target import assemble

    return SelfSpecStudent(assemble(adapter.float(), target_model), adapter.config, max_len)
