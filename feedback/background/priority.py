"""Per-thread niceness for background work that must yield to decoding: the engine's swap
preparer, the Swapper's artifact loads and the trainer actor's training thread."""

from __future__ import annotations

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
