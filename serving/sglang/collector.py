"""Engine-side end of the trace channel: receives the plugin's verify steps from SGLang's scheduler
processes and turns them into VerifyBatch events for the shared observers (trace recorder,
metrics, live acceptance) -- the same events TorchEngine emits."""

from __future__ import annotations

import collections
import logging
import math
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from multiprocessing.connection import Client, Listener

import numpy as np

from feedback.bus.trace import DrafterKind
from serving.engine.base import VerifyBatch
from serving.sglang.exporter import ENV_ADDRESS, ENV_AUTHKEY, StepMessage

log = logging.getLogger(__name__)


def to_verify_batch(message: StepMessage, source: DrafterKind,
                    drafter_version: str) -> VerifyBatch:
    """``positions`` index the *traced* output, ``output[1:]``: SGLang samples the first output
    token in the prefill, so observers see it as the last prompt token (see SGLangEngine)."""
    rows = message.rows
    prompt_lens = np.asarray(message.prompt_lens, dtype=np.int64)
    # The root is the last committed token, so the step's first emitted token sits right after
    # it: output index = root position + 1 - prompt length; traced index = that - 1.
    positions = (rows.root_pos - prompt_lens).astype(np.int32)
    return VerifyBatch(
        request_ids=list(message.request_ids),
        positions=positions,
        num_drafted=rows.num_drafted,
        num_accepted=rows.num_accepted,
        source=np.where(rows.num_drafted > 0, np.uint8(source), np.uint8(DrafterKind.NONE)),
        draft_ids=rows.draft_ids,
        draft_probs=rows.draft_probs,
        emitted=rows.emitted,
        target_topk_ids=rows.target_topk_ids,
        target_topk_logprobs=rows.target_topk_logprobs,
        drafter_version=drafter_version,
    )


class InstallLog:
    """Which draft version was installed when: a verify step waits for export (a device copy, a
    queue, a socket) and may reach the engine after a swap, so it is labelled with the version
    live when its hook ran, not when it arrived. A step hooked while an update was in flight
    counts for the version before it (the new one's rollback watch reads only its own steps)."""

    def __init__(self, version: str, keep: int = 16):
        self._log: collections.deque[tuple[float, str]] = collections.deque([(-math.inf, version)],
                                                                            maxlen=keep)
        self._lock = threading.Lock()

    def add(self, done_at: float, version: str) -> None:
        """``version``'s update completed at ``done_at`` (``time.monotonic()``)."""
        with self._lock:
            self._log.append((done_at, version))

    def version_at(self, hooked_at: float) -> str:
        """The version live at ``hooked_at``; the latest one for 0 (a step without the time)."""
        with self._lock:
            if hooked_at <= 0.0:
                return self._log[-1][1]
            return next((v for t, v in reversed(self._log) if t <= hooked_at), self._log[0][1])


class TraceCollector:
    """Listens on a private Unix socket; ``env()`` is what the scheduler processes need to find it."""

    def __init__(self, on_step: Callable[[StepMessage], None]):
        self._on_step = on_step
        self._dir = tempfile.mkdtemp(prefix="specloop-sglang-")
        self.address = os.path.join(self._dir, "traces.sock")
        self._authkey = os.urandom(16)
        self._listener = Listener(self.address, family="AF_UNIX", authkey=self._authkey)
        self._closed = False
        self.received = 0
        self._threads: list[threading.Thread] = []
        self._spawn(self._accept_loop, "specloop-trace-accept")

    def env(self) -> dict[str, str]:
        return {ENV_ADDRESS: self.address, ENV_AUTHKEY: self._authkey.hex()}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:  # wake the blocking accept() so its thread can see _closed
            Client(self.address, family="AF_UNIX", authkey=self._authkey).close()
        except OSError:
            pass
        self._listener.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _spawn(self, target, name: str, *args) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn = self._listener.accept()
            except Exception as exc:  # noqa: BLE001  (auth failures, closed listener)
                if not self._closed:
                    log.warning("trace collector: rejected a connection (%s)", exc)
                continue
            if self._closed:
                conn.close()
                return
            self._spawn(self._read_loop, "specloop-trace-read", conn)

    def _read_loop(self, conn) -> None:
        with conn:
            while not self._closed:
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    return
                self.received += 1
                try:
                    self._on_step(message)
                except Exception:
                    log.exception("trace collector: observer failed on a verify step")
