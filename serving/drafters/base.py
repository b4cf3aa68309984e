"""The Drafter protocol: anything that proposes up to k tokens per request for the target to verify.

The engine owns the target and the verify loop; a drafter only sees token histories (and, for
learned heads, the target's features) and returns proposals. Drafters keep their own per-request
state (suffix matches, a draft KV cache) keyed by request id. The engine calls, per request:

    add_request(view, features)             once when the request joins (also after a drafter swap,
                                            with the full history so far: draft state is rebuilt)
    propose(views, k) -> DraftProposal      every step, for the whole running batch
    on_verified(request_id, accepted, feats) after every verify step with the tokens it committed
    remove_request(request_id, output_ids)  when the request finishes or is aborted (output_ids is
                                            None on abort); model-free drafters learn here

A drafter that keeps acceptance trials of its own may offer ``on_cut(kept)`` ({request id: nodes
verified}, after every draft): the engine verifies a prefix of each row's proposal (its room, the
goodput policy's widths), and only the verified nodes were trials.

A drafter may also offer ``prepare_request`` (``PreparableDrafter``): a hot swap then builds the
incoming drafter's per-request state on the swapping thread, before it is installed, instead of
between two decode steps (see TorchEngine.swap_drafter).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from feedback.bus.trace import DrafterKind


@dataclass
class DraftRequestView:
    """What a drafter may read of one running request."""

    request_id: str
    token_ids: list[int]
    """Prompt followed by every output token committed so far (the last one is not yet in the
    target's KV cache: it is the first input of the next verify step)."""
    prompt_len: int
    tenant: str = "default"
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    generator: torch.Generator | None = None
    """Per-request RNG (seeded requests); draft sampling should use it when given."""

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]


@dataclass
class DraftProposal:
    """Draft tokens for a batch. Rows may propose fewer than k tokens (``lengths``)."""

    tokens: torch.Tensor  # [B, k] int64, padded with 0 beyond lengths
    lengths: torch.Tensor  # [B] int64, 0..k
    probs: torch.Tensor  # [B, k] float32, q(token) under the draft; 1.0 for deterministic drafts
    source: np.ndarray  # [B] uint8 DrafterKind of each row's proposal
    dists: torch.Tensor | None = None
    """[B, k, V] float32 full draft distributions, or None when every proposal is a point mass
    (deterministic drafts: q(x)=1 for the drafted token). Needed for lossless rejection sampling
    with sampled drafts."""
    confidence: torch.Tensor | None = None
    """[B, k] float32 drafter's own estimate that each token is accepted given the previous ones
    were (suffix: observed continuation frequency; learned: q). The hybrid drafter and adaptive k
    use it; None means unknown."""
    draft_ms: float = 0.0
    catch_up_ms: float = 0.0
    """Of ``draft_ms``, the time spent committing backlogs: the inputs of rows that did not draft
    on their previous steps, beyond what one verify step commits. Drafting every step does not pay
    it; on a probe the speculation policy charges it to the probe, not to drafting."""
    parents: torch.Tensor | None = None
    """[B, k] int64 token tree: the parent of draft j as a draft index (< j), -1 for a child of the
    row's last committed token; None = every row is a chain (parent of j is j - 1). Trees need
    point-mass drafts (``dists`` None). ``confidence`` of a tree node is its acceptance estimate
    given its parent was accepted; nodes must be ordered so that a prefix of them is a subtree
    (e.g. best-first), since the engine may cut a proposal to its first n nodes."""

    @property
    def k(self) -> int:
        return int(self.tokens.shape[1])

    @staticmethod
    def empty(batch_size: int, k: int = 0) -> DraftProposal:
        return DraftProposal(
            tokens=torch.zeros(batch_size, k, dtype=torch.long),
            lengths=torch.zeros(batch_size, dtype=torch.long),
            probs=torch.ones(batch_size, k, dtype=torch.float32),
            source=np.full(batch_size, DrafterKind.NONE, dtype=np.uint8),
        )


def chain_parents(rows: int, k: int) -> torch.Tensor:
    """[rows, k] int64 draft-index parents of chains (draft j's parent is j - 1), writable: the
    ``parents`` of rows that are chains in a proposal that also holds trees."""
    return torch.arange(-1, k - 1).repeat(rows, 1)


@runtime_checkable
class Drafter(Protocol):
    kind: str
    """suffix | eagle | standalone | hybrid"""
    version: str
    """Registry version ("day0" before any training)."""
    feature_layers: tuple[int, ...]
    """Target hidden-state layers (HF ``hidden_states`` indices) this drafter consumes; () if none."""

    def add_request(self, view: DraftRequestView, features: torch.Tensor | None = None) -> None:
        """``features``: [len(view.token_ids) - 1, F] target features for every position already in
        the target's KV cache (all but the last token), or None unless feature_layers is set."""
        ...

    def propose(self, views: list[DraftRequestView], k: int) -> DraftProposal: ...

    def on_verified(
        self, request_id: str, accepted_ids: list[int], features: torch.Tensor | None
    ) -> None:
        """``accepted_ids``: the tokens committed this step (accepted drafts + the bonus token).
        ``features``: [len(accepted_ids), F] target features for the *inputs* of this step whose
        outputs were kept, i.e. the previous last token and the accepted drafts (None unless
        feature_layers is non-empty)."""
        ...

    def remove_request(self, request_id: str, output_ids: list[int] | None) -> None: ...


@dataclass
class DrafterInfo:
    kind: str
    version: str
    extra: dict = field(default_factory=dict)


@runtime_checkable
class PreparableDrafter(Drafter, Protocol):
    """Optional capability: per-request state built off the engine's step thread.

    A hot swap calls ``prepare_request`` on the incoming drafter, from the swapping thread and
    before the drafter is installed, once per running request with a frozen snapshot of its history
    (``view.generator`` is None: the request's RNG belongs to the step thread). The drafter must do
    the costly work there (a learned drafter prefills its draft KV cache) and must not touch state it
    shares with another drafter (the installed one is in use meanwhile). Once installed, the engine
    catches each prepared request up with ``on_verified(request_id, tokens committed since the
    snapshot, their features)`` and ``remove_request(request_id, None)`` for prepared requests that
    ended in between; requests that joined in between get a plain ``add_request``."""

    def prepare_request(
        self, view: DraftRequestView, features: torch.Tensor | None = None
    ) -> None: ...
