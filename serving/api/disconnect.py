"""A request's engine work runs only while its client is connected (a non-streamed one until its
answer, a streamed one until its first chunk, after which its failing writes end it): nobody would
read the answer, and the engine's slot goes to the next request."""

from __future__ import annotations

import asyncio

import anyio
from fastapi import Request

from serving.api.errors import APIError


class ClientDisconnected(APIError):
    """The client went away before a non-streamed response was ready (nobody reads the answer)."""

    def __init__(self):
        super().__init__("client disconnected", 499, "client_closed_request")


async def _wait_for_disconnect(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(work, raw: Request) -> asyncio.Task:
    """``work`` run as a task until it is done or the client disconnects, whichever comes first;
    in the second case the task is cancelled (and awaited) before this returns it."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(raw))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(task, return_exceptions=True)
    return task
