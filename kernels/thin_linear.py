"""thin_linear: ``x @ w.T`` for a few tokens (fp32, CPU) at about the cost of one pass over ``w``.

The CPU kernel is ``kernels/native/thin_linear.c`` (why it exists: see its header). It is compiled
here on first use with the machine's C compiler and ``-march=native`` (AVX-512 or AVX2, whichever
the CPU has), into a cache directory keyed by the source, the compiler and the CPU's flags, so a
second process loads it in milliseconds. Where no compiler is found, or the build fails, or the
inputs are not what the kernel takes (not fp32, not on the CPU, needing gradients), ``thin_linear``
answers with the torch reference ``F.linear`` instead: same contract, only slower.

The loader is ctypes (no torch headers to compile against; the build takes under a second).
ctypes releases the GIL for the call, so other Python threads run while the kernel does.
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
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "native" / "thin_linear.c"
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
MAX_TOKENS = 64
"""Above this many tokens BLAS's gemm is the better path; thin_linear hands over to F.linear."""

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_disabled = os.environ.get("SPECLOOP_THIN_LINEAR", "1") == "0"


def cache_dir() -> Path:
    """Where built kernels are kept: $SPECLOOP_KERNEL_CACHE, else ~/.cache/specloop/kernels."""
    env = os.environ.get("SPECLOOP_KERNEL_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specloop" / "kernels"


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return ""


def _build(cc: str) -> Path:
    """Compile the kernel (once per source/compiler/CPU) and return the shared object's path."""
    version = subprocess.run([cc, "--version"], check=False, capture_output=True, text=True).stdout
    key = hashlib.sha256(
        "\0".join([SOURCE.read_text(), version, " ".join(CFLAGS), _cpu_flags()]).encode()
    ).hexdigest()[:16]
    out = cache_dir() / f"thin_linear-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run(
            [cc, *CFLAGS, str(SOURCE), "-o", tmp], check=True, capture_output=True, text=True
        )
        os.replace(tmp, out)  # atomic: a concurrent build of the same key loses nothing
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _load() -> ctypes.CDLL | None:
    global _lib, _tried
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        cc = _compiler()
        if _disabled:
            log.info("thin_linear: native kernel disabled (SPECLOOP_THIN_LINEAR=0)")
        elif cc is None:
            log.warning("thin_linear: no C compiler found; using F.linear")
        else:
            try:
                lib = ctypes.CDLL(str(_build(cc)))
                lib.thin_linear.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3 + [
                    ctypes.c_int
                ]
                lib.thin_linear.restype = ctypes.c_int
                lib.thin_linear_vector_width.restype = ctypes.c_int
                _lib = lib
            except (OSError, subprocess.CalledProcessError) as e:
                detail = getattr(e, "stderr", "") or str(e)
                log.warning("thin_linear: native build failed (%s); using F.linear", detail[-500:])
        _tried = True
        return _lib


def available() -> bool:
    """Whether the native kernel is built and loaded (builds it on first call)."""
    return _load() is not None


def vector_width() -> int:
    """Floats per vector register the kernel was built for (16 = AVX-512, 8 = AVX2); 0 = none."""
    lib = _load()
    return int(lib.thin_linear_vector_width()) if lib is not None else 0


def _takes(x: torch.Tensor, w: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and w.device.type == "cpu"
        and x.dtype == torch.float32
        and w.dtype == torch.float32
        and w.dim() == 2
        and w.is_contiguous()
        and x.shape[-1] == w.shape[1]
        and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
    )


def thin_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` (``F.linear(x, w)``): x [..., K], w [N, K] -> [..., N]."""
    tokens = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not (0 < tokens <= MAX_TOKENS) or not _takes(x, w):
        return F.linear(x, w)
    lib = _load()
    if lib is None:
        return F.linear(x, w)
    x2 = x.reshape(tokens, x.shape[-1]).contiguous()  # [T, K]
    y = torch.empty(tokens, w.shape[0], dtype=torch.float32)  # [T, N]
    rc = lib.thin_linear(
        x2.data_ptr(), w.data_ptr(), y.data_ptr(), tokens, w.shape[0], w.shape[1],
        torch.get_num_threads(),
    )
    if rc != 0:  # arguments the kernel refused: never silently wrong
        raise RuntimeError(f"thin_linear refused shapes x={tuple(x.shape)} w={tuple(w.shape)}")
    return y.reshape(*x.shape[:-1], w.shape[0])
