"""Per-request state of the TorchEngine: the client's queue and one running row of the batch."""

from __future__ import annotations

import asyncio
import dataclasses
import random

import torch

from serving.drafters.base import DraftRequestView
from serving.engine.base import GenerationChunk, GenerationRequest, SpecStats
from serving.output import OutputText, stop_token_set

_seed_source = random.SystemRandom()


@dataclasses.dataclass
class Client:
    """Where a request's chunks go: an asyncio queue on the caller's event loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def send(self, item: GenerationChunk | BaseException) -> bool:
        """Thread-safe; False when the caller's loop is gone."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
            return True
        except RuntimeError:  # loop closed
            return False


@dataclasses.dataclass
class Submission:
    request: GenerationRequest
    client: Client


class Row:
    """A running request: its tokens, stop rules, RNG, detokeniser and statistics."""

    def __init__(
        self,
        sub: Submission,
        tokenizer,
        eos_ids: frozenset[int],
        max_context: int,
    ):
        req = sub.request
        p = req.params
        self.request = req
        self.client = sub.client
        self.prompt_len = len(req.prompt_ids)
        self.token_ids: list[int] = [int(t) for t in req.prompt_ids]
        """Prompt + committed output; the last one is not in the KV cache yet."""
        self.max_total = min(self.prompt_len + p.max_tokens, max_context)
        self.stop_ids = stop_token_set(p.stop_token_ids, eos_ids, p.ignore_eos)
        self.seed = p.seed if p.seed is not None else _seed_source.getrandbits(63)
        self.generator = torch.Generator().manual_seed(self.seed & ((1 << 63) - 1))
        self.text = OutputText(tokenizer, req.prompt_ids, p.stop, skip_special_tokens=p.skip_special_tokens)
        self.stats = SpecStats()
        self.draft_ok = True
        """False when the drafter refused this request: it then decodes without drafts."""
        self.features: list[torch.Tensor] = []
        """Target features of every token in the KV cache (chunks), when the drafter needs them."""
        self.features_layers: tuple[int, ...] = ()
        self.view = DraftRequestView(
            request_id=req.request_id,
            token_ids=self.token_ids,  # shared: the drafter always sees the current history
            prompt_len=self.prompt_len,
            tenant=req.tenant,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            generator=self.generator,
        )

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def params(self):
        return self.request.params

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def room(self) -> int:
        """Tokens this request may still emit (max_tokens and the context limit)."""
        return self.max_total - len(self.token_ids)

    def chunk(self, token_ids: list[int], text: str, finish_reason: str | None) -> GenerationChunk:
        return GenerationChunk(
            request_id=self.request_id,
            token_ids=token_ids,
            text=text,
            finished=finish_reason is not None,
            finish_reason=finish_reason,
            prompt_tokens=self.prompt_len,
            completion_tokens=self.num_output,
            stats=dataclasses.replace(self.stats),
        )
