"""Scheduler-side export of verify steps to the engine process.

SGLang's scheduler runs in spawned processes where none of the parent's objects exist, so the
plugin finds its way home through environment variables that SGLangEngine sets before launch (a
Unix socket and an auth key). The hook only enqueues; a thread waits for the device-to-host copy,
unpacks and sends. A full queue or an unreachable engine sheds steps (counted), never the request.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client

import torch

from serving.sglang.reduction import StepLayout, StepRows, unpack_step

log = logging.getLogger(__name__)

ENV_ADDRESS = "SPECLOOP_SGLANG_TRACE_ADDRESS"
"""Unix socket of the engine's TraceCollector; unset = the plugin registers no hook."""
ENV_AUTHKEY = "SPECLOOP_SGLANG_TRACE_AUTHKEY"
"""Hex auth key for that socket."""
ENV_SAMPLE_RATE = "SPECLOOP_SGLANG_TRACE_SAMPLE_RATE"
"""Fraction of requests whose steps are captured (by request id hash), default 1.0."""
ENV_TOP_K = "SPECLOOP_SGLANG_TRACE_TOP_K"
"""Target top-k kept per verified position, default 20."""
ENV_QUEUE = "SPECLOOP_SGLANG_TRACE_QUEUE"
"""Steps that may wait for export before new ones are shed, default 256."""


@dataclass
class StepMessage:
    """What crosses the process boundary for one verify step."""

    request_ids: list[str]
    prompt_lens: list[int]
    rows: StepRows
    hooked_at: float = 0.0
    """``time.monotonic()`` in the scheduler when the step's hook ran (the clock is system-wide on
    Linux): which draft weights drafted it, since a swap may land while it waits for export."""


@dataclass(frozen=True)
class ExportConfig:
    address: str
    authkey: bytes
    sample_rate: float = 1.0
    top_k: int = 20
    max_queue: int = 256

    @classmethod
    def from_env(cls, env=os.environ) -> ExportConfig | None:
        address = env.get(ENV_ADDRESS)
        if not address:
            return None
        return cls(
            address=address,
            authkey=bytes.fromhex(env.get(ENV_AUTHKEY, "")),
            sample_rate=float(env.get(ENV_SAMPLE_RATE, "1.0")),
            top_k=int(env.get(ENV_TOP_K, "20")),
            max_queue=int(env.get(ENV_QUEUE, "256")),
        )


def copy_to_host(packed: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """The step's one device-to-host copy, asynchronous on GPU (pinned buffer + event)."""
    if not packed.is_cuda:
        return packed.clone(), None
    host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
    host.copy_(packed, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready


class StepExporter:
    def __init__(self, config: ExportConfig, connect=Client):
        self.config = config
        self._connect = connect
        self._conn = None
        self._retry_at = 0.0
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue)
        self.sent = 0
        self.shed = 0
        self._thread = threading.Thread(target=self._run, name="specloop-trace-export", daemon=True)
        self._thread.start()

    def submit(self, packed: torch.Tensor, layout: StepLayout, request_ids: list[str],
               prompt_lens: list[int]) -> None:
        """Never blocks: copy, enqueue, or count the step as shed."""
        if self._queue.full():
            self.shed += 1
            return
        hooked_at = time.monotonic()
        host, ready = copy_to_host(packed)
        try:
            self._queue.put_nowait((host, ready, layout, request_ids, prompt_lens, hooked_at))
        except queue.Full:
            self.shed += 1

    def close(self, timeout: float = 5.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)
        if self._conn is not None:
            self._conn.close()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            host, ready, layout, request_ids, prompt_lens, hooked_at = item
            if ready is not None:
                ready.synchronize()
            rows = unpack_step(host.numpy(), layout)
            self._send(StepMessage(request_ids, prompt_lens, rows, hooked_at))

    def _send(self, message: StepMessage) -> None:
        try:
            if self._conn is None:
                if time.monotonic() < self._retry_at:
                    self.shed += 1
                    return
                self._conn = self._connect(self.config.address, family="AF_UNIX",
                                           authkey=self.config.authkey)
            self._conn.send(message)
            self.sent += 1
        except (OSError, EOFError, AuthenticationError) as exc:
            self.shed += 1
            if self._conn is not None:
                self._conn.close()
            self._conn = None
            self._retry_at = time.monotonic() + 1.0
            log.warning("specloop trace export to %s failed (%s); shedding steps",
                        self.config.address, exc)
