"""Build and load specloop's native CPU kernels (``kernels/native/*.c``).

Each kernel is compiled on first use with the machine's C compiler and ``-march=native``
(AVX-512 or AVX2, whichever the CPU has) into a cache directory keyed by the source, the compiler
and the CPU's flags, so a second process loads it in milliseconds, and loaded with ctypes (no torch
headers to build against; the build takes under a second; ctypes releases the GIL for each call).
Every kernel runs on one set of worker threads per process, ``native/pool.c`` (why not OpenMP:
``native/pool.h``), which is built like a kernel and loaded first with ``RTLD_GLOBAL``, so that
the kernels' calls to it resolve to the one copy. Where no compiler is found or the build fails,
``load`` returns None and the caller uses its torch reference; ``SPECLOOP_NATIVE_KERNELS=0``
forces that everywhere.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from kernels.cpu import flags_line

log = logging.getLogger(__name__)

NATIVE_DIR = Path(__file__).parent / "native"
CFLAGS = ("-O3", "-march=native", "-pthread", "-shared", "-fPIC", "-std=gnu11")
LIBS = ("-lm",)
POOL = "pool"
"""The worker threads' library (native/pool.c): loaded before, and shared by, every kernel."""

_lock = threading.RLock()  # re-entered: loading a kernel loads the pool first
_loaded: dict[str, ctypes.CDLL | None] = {}


def disabled() -> bool:
    return os.environ.get("SPECLOOP_NATIVE_KERNELS", "1") == "0"


def cache_dir() -> Path:
    """Where built kernels are kept: $SPECLOOP_KERNEL_CACHE, else ~/.cache/specloop/kernels."""
    env = os.environ.get("SPECLOOP_KERNEL_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specloop" / "kernels"


def compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def build(name: str, cc: str) -> Path:
    """Compile ``native/<name>.c`` (once per source, headers, compiler and CPU); the shared
    object's path."""
    source = NATIVE_DIR / f"{name}.c"
    headers = [h.read_text() for h in sorted(NATIVE_DIR.glob("*.h"))]
    version = subprocess.run([cc, "--version"], check=False, capture_output=True, text=True).stdout
    key = hashlib.sha256(
        "\0".join([source.read_text(), *headers, version, " ".join(CFLAGS), flags_line()]).encode()
    ).hexdigest()[:16]
    out = cache_dir() / f"{name}-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run(
            [cc, *CFLAGS, str(source), "-o", tmp, *LIBS], check=True, capture_output=True, text=True
        )
        os.replace(tmp, out)  # atomic: a concurrent build of the same key loses nothing
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def load(name: str, declare: Callable[[ctypes.CDLL], None]) -> ctypes.CDLL | None:
    """The kernel ``name`` built and loaded (``declare`` sets its functions' ctypes signatures),
    or None where it cannot be: the caller then uses its torch reference. Tried once per process."""
    if name in _loaded:
        return _loaded[name]
    with _lock:
        if name in _loaded:
            return _loaded[name]
        lib = None
        cc = compiler()
        if disabled():
            log.info("%s: native kernels disabled (SPECLOOP_NATIVE_KERNELS=0)", name)
        elif cc is None:
            log.warning("%s: no C compiler found; using the torch reference", name)
        else:
            try:
                if name != POOL and load(POOL, lambda _: None) is None:
                    raise OSError("the worker pool (native/pool.c) did not load")
                mode = ctypes.RTLD_GLOBAL if name == POOL else ctypes.DEFAULT_MODE
                lib = ctypes.CDLL(str(build(name, cc)), mode=mode)
                declare(lib)
            except (OSError, AttributeError, subprocess.CalledProcessError) as e:
                detail = getattr(e, "stderr", "") or str(e)
                log.warning("%s: native build failed (%s); using the torch reference", name,
                            detail[-500:])
                lib = None
        _loaded[name] = lib
        return lib

