"""Per-thread niceness for background work that must yield to decoding: the engine's swap
preparer, the Swapper's artifact loads and the trainer actor's training thread."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import sys
import threading

from kernels.threads import compute_alone

log = logging.getLogger(__name__)


def lower_thread_priority(nice: int, what: str) -> None:
    """Make the calling thread ``nice`` steps nicer (Linux: niceness is per thread; threads it
    starts afterwards, such as its OpenMP team, inherit it). Irreversible without privileges, so
    call it from a thread of its own. ``what`` names the thread in the warning if it fails."""
    if nice <= 0 or not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError as e:
        log.warning("could not lower the %s's priority: %s", what, e)


def become_background(nice: int, what: str) -> None:
    """The calling thread becomes background work beside the decode steps: ``nice`` steps nicer
    and its tensor work on itself alone (kernels.threads.compute_alone), never on the worker
    threads the steps use. For a thread of its own (both are irreversible)."""
    lower_thread_priority(nice, what)
    compute_alone()


class BackgroundWorker:
    """One worker thread for background work beside the decode steps (``become_background``),
    started at the first ``submit``; ``stop`` lets it go, and a later ``submit`` starts a fresh
    one. Thread-safe."""

    def __init__(self, name: str, nice: int, what: str):
        self.name, self.nice, self.what = name, nice, what
        self._lock = threading.Lock()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None

    def submit(self, fn, *args) -> concurrent.futures.Future:
        with self._lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    1, self.name, initializer=become_background, initargs=(self.nice, self.what))
            return self._executor.submit(fn, *args)

    def stop(self) -> None:
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False)
