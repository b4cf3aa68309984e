"""Tiny targets, test-only drafters and helpers for the engine tests.

Test drafters live here (not in serving/): they cheat (replay a known continuation) or misbehave on
purpose, to exercise verification with good, bad, sampled and failing proposals.
"""

from __future__ import annotations

import asyncio
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from feedback.bus.trace import DrafterKind
from serving.drafters.base import DraftProposal, DraftRequestView
from serving.engine.base import GenerationRequest, SamplingParams
from serving.target import Target, tiny_target


@pytest.fixture(autouse=True, scope="session")
def _few_threads():
    torch.set_num_threads(1)  # 2 shared cores; tiny models gain nothing from more


class RecordingDrafter:
    """Base: records the engine's calls; proposes nothing."""

    kind = "suffix"
    source = DrafterKind.SUFFIX

    def __init__(self, version: str = "v1", feature_layers: tuple[int, ...] = ()):
        self.version = version
        self.feature_layers = feature_layers
        self.added: dict[str, tuple[list[int], torch.Tensor | None]] = {}
        self.verified: dict[str, list[tuple[list[int], torch.Tensor | None]]] = {}
        self.removed: dict[str, list[int] | None] = {}
        self.proposed_steps = 0

    def add_request(self, view: DraftRequestView, features=None) -> None:
        self.added[view.request_id] = (list(view.token_ids), features)
        self.verified[view.request_id] = []

    def on_verified(self, request_id, accepted_ids, features) -> None:
        self.verified[request_id].append((list(accepted_ids), features))

    def remove_request(self, request_id, output_ids) -> None:
        self.removed[request_id] = output_ids

    def drafts(self, view: DraftRequestView, k: int) -> list[int]:
        return []

    def propose(self, views: list[DraftRequestView], k: int) -> DraftProposal:
        self.proposed_steps += 1
        tokens = torch.zeros(len(views), k, dtype=torch.long)
        lengths = torch.zeros(len(views), dtype=torch.long)
        for i, view in enumerate(views):
            d = self.drafts(view, k)[:k]
            tokens[i, : len(d)] = torch.tensor(d, dtype=torch.long)
            lengths[i] = len(d)
        return DraftProposal(
            tokens=tokens,
            lengths=lengths,
            probs=torch.ones(len(views), k),
            source=np.full(len(views), self.source, dtype=np.uint8),
        )


class ReplayDrafter(RecordingDrafter):
    """Proposes the known reference continuation, with every ``corrupt_every``-th output
    position replaced by a wrong token (0 = never)."""

    def __init__(
        self, references: dict[tuple, list[int]], vocab: int, corrupt_every: int = 0, **kw
    ):
        super().__init__(**kw)
        self.refs, self.vocab, self.corrupt = references, vocab, corrupt_every

    def drafts(self, view, k):
        ref = self.refs.get(tuple(view.token_ids[: view.prompt_len]), [])
        n = len(view.token_ids) - view.prompt_len
        out = []
        for pos in range(n, min(n + k, len(ref))):
            tok = ref[pos]
            if self.corrupt and pos % self.corrupt == self.corrupt - 1:
                tok = (tok + 1) % self.vocab
            out.append(tok)
        return out


class GarbageDrafter(RecordingDrafter):
    """Random tokens, random lengths."""

    def __init__(self, vocab: int, seed: int = 0, **kw):
        super().__init__(**kw)
        self.vocab, self.rng = vocab, np.random.default_rng(seed)

    def drafts(self, view, k):
        return self.rng.integers(0, self.vocab, int(self.rng.integers(0, k + 1))).tolist()


class FixedDistDrafter(RecordingDrafter):
    """Samples every draft from one fixed distribution q and reports it (``dists``): exercises
    rejection sampling with a stochastic drafter."""

    kind = "standalone"
    source = DrafterKind.STANDALONE

    def __init__(self, q: np.ndarray, seed: int = 0, **kw):
        super().__init__(**kw)
        self.q = torch.as_tensor(q, dtype=torch.float32)
        self.gen = torch.Generator().manual_seed(seed)

    def propose(self, views, k):
        self.proposed_steps += 1
        n = len(views)
        tokens = torch.multinomial(self.q.expand(n * k, -1), 1, generator=self.gen).view(n, k)
        return DraftProposal(
            tokens=tokens,
            lengths=torch.full((n,), k, dtype=torch.long),
            probs=self.q[tokens],
            source=np.full(n, self.source, dtype=np.uint8),
            dists=self.q.expand(n, k, -1).clone(),
        )


class FailingDrafter(RecordingDrafter):
    """Raises where told to: 'propose', 'add_request' or 'on_verified'."""

    def __init__(self, where: str, **kw):
        super().__init__(**kw)
        self.where = where

    def add_request(self, view, features=None):
        if self.where == "add_request":
            raise RuntimeError("drafter refuses")
        super().add_request(view, features)

    def on_verified(self, request_id, accepted_ids, features):
        if self.where == "on_verified":
            raise RuntimeError("drafter breaks")
        super().on_verified(request_id, accepted_ids, features)

    def propose(self, views, k):
        if self.where == "propose":
            raise RuntimeError("drafter crashes")
        if self.where == "propose_bad_shape":
            return DraftProposal.empty(len(views) + 1, k)
        return super().propose(views, k)


@pytest.fixture
def drafters():
    return SimpleNamespace(
        Recording=RecordingDrafter,
        Replay=ReplayDrafter,
        Garbage=GarbageDrafter,
        FixedDist=FixedDistDrafter,
        Failing=FailingDrafter,
    )


# ---- targets ---------------------------------------------------------------------------------

# Where the shared tiny targets live. CI has no GPU; on a GPU machine
# ``SPECLOOP_TEST_DEVICE=cuda pytest tests/serving/test_tree_engine.py ...`` runs the engine's tests
# with the target on CUDA (benchmarks/gpu_check.sh).
TEST_DEVICE = os.environ.get("SPECLOOP_TEST_DEVICE", "cpu")


def _placed(target: Target) -> Target:
    target.model.to(TEST_DEVICE)
    return target


@pytest.fixture(scope="session")
def ids_target() -> Target:
    """Token-id-only tiny Llama (fp32): exact numerics, millisecond steps."""
    return _placed(tiny_target(vocab_size=101, hidden_size=64, num_layers=2, seed=3))


def peaked_target(vocab_size: int = 8, seed: int = 5, scale: float = 0.2) -> Target:
    """Tiny target with context-dependent, far-from-uniform next-token distributions (random init
    alone gives near-uniform logits, which would make a distribution test blind): an untied random
    lm_head of a chosen scale."""
    t = tiny_target(vocab_size=vocab_size, hidden_size=32, num_layers=2, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        weight = torch.randn(vocab_size, 32, generator=gen) * scale
        t.model.lm_head.weight = torch.nn.Parameter(weight)
    return _placed(t)


@pytest.fixture(scope="session")
def peaked():
    return peaked_target


@pytest.fixture(scope="session")
def text_target() -> Target:
    """Tiny random Llama on the real SmolLM2 tokenizer: text in and out works."""
    return _placed(tiny_target(hidden_size=32, num_layers=2, seed=7))


# ---- running requests --------------------------------------------------------------------------


async def collect(engine, request: GenerationRequest, delay: float = 0.0):
    """All chunks of one request (optionally submitted after ``delay`` seconds)."""
    if delay:
        await asyncio.sleep(delay)
    return [chunk async for chunk in engine.generate(request)]


def tokens_of(chunks) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def text_of(chunks) -> str:
    return "".join(c.text for c in chunks)


def greedy(max_tokens: int = 32, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


@pytest.fixture
def run():
    """``run(engine_factory_or_engine, [requests], delays=None)`` -> list of chunk lists; starts
    and stops the engine around the batch."""

    def _run(engine, requests, delays=None):
        async def main():
            await engine.start()
            try:
                ds = delays or [0.0] * len(requests)
                return await asyncio.gather(*[collect(engine, r, d) for r, d in zip(requests, ds)])
            finally:
                await engine.stop()

        return asyncio.run(main())

    return _run


class SwapAfterSteps:
    """An engine observer that swaps in ``drafter`` from the step thread after ``steps`` verify
    steps: the swap point then does not depend on how far the step thread runs ahead of the event
    loop that reads the chunks (on a loaded 2-core CI machine it can finish a request first)."""

    def __init__(self, steps: int, drafter):
        self.steps, self.drafter, self.engine, self.seen = steps, drafter, None, 0

    def on_step(self, batch) -> None:
        self.seen += 1
        if self.seen == self.steps:
            self.engine.swap_drafter(self.drafter)

    def watch(self, engine):
        """Attach to ``engine`` (as one of its observers) and return it."""
        self.engine = engine
        engine.observers.append(self)
        return engine


@pytest.fixture
def helpers():
    return SimpleNamespace(
        collect=collect, tokens_of=tokens_of, text_of=text_of, greedy=greedy,
        SwapAfterSteps=SwapAfterSteps,
    )
