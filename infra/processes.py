"""Low-level process, port and health helpers of the local stack (infra/stack.py): a process's
start time from /proc (to tell a live service from a recycled pid), its process group's members,
stopping a whole group, who writes to a run directory's logs, a log's tail, and the per-service
health checks."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotation only: infra/stack.py imports this module
    from infra.stack import ServiceInfo


# ---- process helpers ---------------------------------------------------------------------------

def _proc_stat(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rindex(")") + 2:].split()  # fields from 3 (state) on; comm may hold spaces


def _start_time(pid: int) -> int | None:
    """Start time of a live (non-zombie) process, None if there is none with this pid."""
    stat = _proc_stat(pid)
    return int(stat[19]) if stat and stat[0] != "Z" else None  # field 22


def _alive(pid: int, start_time: int) -> bool:
    return _start_time(pid) == start_time


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is ``pgid``."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _proc_stat(int(entry.name))
            if stat and stat[0] != "Z" and int(stat[2]) == pgid:
                members.append(int(entry.name))
    return members


def _kill_group(pgid: int, grace_s: float, child: subprocess.Popen | None) -> None:
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, sig)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if child is not None:
                child.poll()  # reap our own child so it does not linger as a zombie
            if not _group_members(pgid):
                if child is not None:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        child.wait(timeout=1.0)
                return
            time.sleep(0.05)


def _log_writers(directory: Path) -> dict[int, set[str]]:
    """Process groups whose live members write their output (fd 1 or 2) to a ``*.log`` in
    ``directory``, with those logs' names: the stack's services when its state file cannot say.
    Only groups that lead a session of their own, as the stack starts each service (never, say,
    a shell's job that was pointed at a log)."""
    groups: dict[int, set[str]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        stat = _proc_stat(int(entry.name))
        if not stat or stat[0] == "Z" or stat[2] != stat[3]:  # fields 5 and 6: pgrp, session
            continue
        for fd in ("1", "2"):
            try:
                target = Path(os.readlink(entry / "fd" / fd))
            except OSError:  # gone, or another user's
                continue
            if target.parent == directory and target.suffix == ".log":
                groups.setdefault(int(stat[2]), set()).add(target.name)
    return groups


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


# ---- health checks -----------------------------------------------------------------------------

def _tcp_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _redis_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as resp:
            return resp.status == 200
    except OSError:
        return False


def _check(name: str, info: ServiceInfo) -> bool:
    if name.startswith("serving"):
        return _http_ok(f"{info.url}/health")
    if name.startswith("trainer"):
        return _alive(info.pid, info.start_time)  # no port: alive is healthy
    if name == "redis":
        return _redis_ping(info.port)
    if name == "mlflow":
        return _http_ok(f"{info.url}/health")
    if name == "s3":
        return _http_ok(info.url)
    return _tcp_open(info.port)
