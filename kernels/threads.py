"""Who computes on which threads: the decode steps' kernels, their torch ops, background work.

A serving process runs its decode steps on two sets of worker threads: the native kernels' pool
(native/pool.c) and torch's OpenMP team of the step thread. A background thread that does tensor
work (a hot swap preparing the new drafter's caches, an artifact being checked) would otherwise
take the pool's workers whenever it calls a kernel between two of the step thread's calls, and
start an OpenMP team of its own as wide as the machine: on two cores, three or four busy threads
then share them and every decode step waits for its slowest worker. ``compute_alone()`` makes
the calling thread do its tensor work on itself: its native kernel calls run alone, and its
OpenMP regions (torch's intra-op parallelism, oneDNN) run with one thread.

``serial_torch(n)`` is for the decode step thread itself. Its native kernels run on the pool, n
wide; but every torch op it runs between them that is big enough to go parallel (the verify's
argmax over [B, q, V] logits, the rotary's cos at more than one token per row) wakes an OpenMP team
whose idle worker then spins before it sleeps: GOMP_SPINCOUNT's default 300,000 iterations of a
pause instruction, ~15 ms on Intel cores where a pause takes ~140 cycles. On two cores that worker
takes a core from the pool for the rest of the step: on a 2-core Xeon a forward of 8 rows x 2
tokens took 103-110 ms against 45-58 ms with the step thread's torch ops serial (one token per row:
~40 ms either way). So the step thread's torch ops run on it alone, and the kernels take their
width from ``kernel_threads()`` rather than from torch's (now 1) on that thread.
"""

from __future__ import annotations

import ctypes
import logging
import threading

import torch

from kernels.native_build import POOL
from kernels.native_build import load as load_native

log = logging.getLogger(__name__)

_width = threading.local()
"""Per thread: the pool width its native kernel calls use, when ``serial_torch`` set one."""


def _loaded_library(*names: str) -> ctypes.CDLL | None:
    """A shared library this process has already loaded whose file name contains one of
    ``names`` (found in the process's mappings; None where there is none)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if any(n in line for n in names)}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


def _set_threads(lib: ctypes.CDLL | None, symbol: str) -> bool:
    fn = getattr(lib, symbol, None) if lib is not None else None
    if fn is None:
        return False
    fn.argtypes, fn.restype = [ctypes.c_int], None
    fn(1)
    return True


def compute_alone() -> None:
    """From now on the calling thread's tensor work runs on that thread only (see the module
    docstring). Per thread and irreversible by design: call it from a thread of its own."""
    _width.n = 1
    _omp_one_thread()
    pool = load_native(POOL, lambda _: None)
    if pool is not None:
        pool.spl_run_alone.argtypes, pool.spl_run_alone.restype = [ctypes.c_int], None
        pool.spl_run_alone(1)


def _omp_one_thread() -> None:
    """This thread's OpenMP regions and MKL calls run on it alone (both are per-thread settings)."""
    torch.get_num_threads()  # torch sets a new thread's OpenMP width on first use: do that first
    # OpenMP's width is an ICV of the calling thread (torch's parallel_for, oneDNN); MKL's fp32
    # gemm keeps its own, per thread through mkl_set_num_threads_local (linked into libtorch;
    # its C entry point is MKL_Set_Num_Threads_Local, the lower-case symbol takes a pointer).
    if not _set_threads(_loaded_library("libgomp", "libiomp"), "omp_set_num_threads"):
        log.debug("no OpenMP runtime found; this thread's torch ops stay parallel")
    _set_threads(_loaded_library("libtorch_cpu"), "MKL_Set_Num_Threads_Local")


def serial_torch(kernel_width: int) -> None:
    """From now on the calling thread's torch ops run on it alone and its native kernel calls on
    ``kernel_width`` pool workers (see the module docstring). Per thread: for the decode step
    thread, called once when it starts."""
    _width.n = max(1, int(kernel_width))
    _omp_one_thread()


def kernel_threads() -> int:
    """Workers a native kernel called from this thread may use: what ``serial_torch`` set for it,
    else torch's intra-op width."""
    n = getattr(_width, "n", None)
    return n if n is not None else torch.get_num_threads()


def on_a_step_thread(fn, kernel_width: int | None = None):
    """``fn()`` run on a new thread set up as serving's decode step thread (``serial_torch`` at
    ``kernel_width``, default torch's width here), its result returned and its exception raised:
    for timings that should read what the step thread pays."""
    width = torch.get_num_threads() if kernel_width is None else kernel_width
    box: dict = {}

    def run() -> None:
        serial_torch(width)
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            box["error"] = e

    t = threading.Thread(target=run, name="step-thread-timing")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]
