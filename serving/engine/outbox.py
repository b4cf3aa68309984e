"""Outbox: the step thread's replies to clients, held until its next stretch without the GIL.

A chunk handed to a client's event loop (``Client.send``) wakes that loop's thread, which then runs
Python: the request's coroutine, the HTTP response, asyncio's own bookkeeping. Handed over as each
row commits, that work ran while the step thread ran Python of its own (the drafter's propose, the
policy, the next forward's preparation), and the two threads took turns at the GIL: a one-token
learned draft right after a verify waited ~0.2 ms for it (``time.sleep(0)`` there read 0.17 ms),
and cost 0.117-0.123 of a 2-token verify against 0.099-0.108 with the chunks held (ARCHITECTURE.md,
"Replies held for the forward"). Held until the next target forward enters its layers, which run
in native code without the GIL, the loop's work runs beside them instead.

Every reply the step thread makes goes through the outbox, so a request's chunks and its error or
end arrive in the order they were made. The engine flushes it where the step thread is about to
compute without the GIL or to wait: the forward's ``before_layers``, before a prefill
(``RowMembership._admit``), before a swap or a snapshot, when the batch is empty, at shutdown
(``TorchEngine._run``). A chunk waits at most one draft and a forward's preparation, ~2 ms on a
2-core CPU: the next token is a whole step away anyway.
"""

from __future__ import annotations

from serving.engine.base import GenerationChunk
from serving.engine.rows import Client


class Outbox:
    def __init__(self) -> None:
        self._held: list[tuple[Client, GenerationChunk | BaseException]] = []

    def send(self, client: Client, item: GenerationChunk | BaseException) -> bool:
        """Hold ``item`` for ``client``; False when the client's event loop is gone (as
        ``Client.send``: the caller then aborts the request)."""
        if client.loop.is_closed():
            return False
        self._held.append((client, item))
        return True

    def flush(self) -> None:
        """Hand every held reply to its client's event loop, in the order they were made."""
        if not self._held:
            return
        held, self._held = self._held, []
        for client, item in held:
            client.send(item)  # a loop closed since: the next send for that row says so

    def __len__(self) -> int:
        return len(self._held)
