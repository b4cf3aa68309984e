"""Keep a background thread's numerics off the cores the decode steps use.

A serving process runs its decode steps on two sets of worker threads: the native kernels' pool
(native/pool.c) and torch's OpenMP team of the step thread. A background thread that does tensor
work (a hot swap preparing the new drafter's caches, an artifact being checked) would otherwise
take the pool's workers whenever it calls a kernel between two of the step thread's calls, and
start an OpenMP team of its own as wide as the machine: on two cores, three or four busy threads
then share them and every decode step waits for its slowest worker. ``compute_alone()`` makes
the calling thread do its tensor work on itself: its native kernel calls run alone, and its
OpenMP regions (torch's intra-op parallelism, oneDNN) run with one thread.
"""

from __future__ import annotations

import ctypes
import logging

from kernels import native_build

log = logging.getLogger(__name__)


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
    import torch

    torch.get_num_threads()  # torch sets a new thread's OpenMP width on first use: do that first
    # OpenMP's width is an ICV of the calling thread (torch's parallel_for, oneDNN); MKL's fp32
    # gemm keeps its own, per thread through mkl_set_num_threads_local (linked into libtorch;
    # its C entry point is MKL_Set_Num_Threads_Local, the lower-case symbol takes a pointer).
    if not _set_threads(_loaded_library("libgomp", "libiomp"), "omp_set_num_threads"):
        log.debug("no OpenMP runtime found; this thread's torch ops stay parallel")
    _set_threads(_loaded_library("libtorch_cpu"), "MKL_Set_Num_Threads_Local")
    pool = native_build.load(native_build.POOL, lambda _: None)
    if pool is not None:
        pool.spl_run_alone.argtypes, pool.spl_run_alone.restype = [ctypes.c_int], None
        pool.spl_run_alone(1)
