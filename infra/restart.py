"""``specloop restart-policy POLICY -- CMD ...``: compose's ``restart:`` policy for a local process.

docker-compose.yml restarts the serving and trainer containers (``restart: unless-stopped``);
``specloop up`` runs them as plain processes, so it wraps each command in this supervisor. It runs
CMD, and when CMD exits it starts it again (after a backoff of 1 s, doubling up to 30 s, reset
after a minute of uptime), unless the policy says otherwise or the supervisor itself was asked to
stop (SIGTERM/SIGINT, which it forwards to CMD). Policies, as in compose: ``no``, ``on-failure``
(restart on a non-zero exit or a signal), ``always`` and ``unless-stopped`` (both: restart on any
exit; "stopped" is ``specloop down``).

CMD stays in the supervisor's process group, so ``specloop down`` (which signals the whole group)
stops both, and CMD's own children with them.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Annotated

import typer

POLICIES = ("no", "on-failure", "always", "unless-stopped")


def supervise(cmd: list[str], policy: str = "unless-stopped", max_backoff_s: float = 30.0) -> int:
    """Run ``cmd`` under ``policy`` until told to stop; the last exit code."""
    if policy not in POLICIES:
        raise ValueError(f"restart policy {policy!r}: one of {', '.join(POLICIES)}")
    stop = threading.Event()
    child: list[subprocess.Popen] = []

    def on_signal(signum, _frame) -> None:
        stop.set()
        if child and child[0].poll() is None:
            child[0].send_signal(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    delay, restarts = 0.5, 0
    while True:
        started = time.monotonic()
        child[:] = [subprocess.Popen(cmd)]
        code = child[0].wait()
        if stop.is_set() or policy == "no" or (policy == "on-failure" and code == 0):
            return code
        restarts += 1
        delay = 1.0 if time.monotonic() - started > 60 else min(max_backoff_s, delay * 2)
        print(f"restart-policy: {cmd[0]} exited with {code}; restart {restarts} in {delay:.0f} s",
              file=sys.stderr, flush=True)
        if stop.wait(delay):
            return code


def cmd_restart_policy(
    policy: Annotated[str, typer.Argument(help="no | on-failure | always | unless-stopped")],
    cmd: Annotated[list[str], typer.Argument(help="The command to keep running (after --).")],
) -> None:
    """Keep a command running under a docker-compose restart policy (what `specloop up` uses)."""
    if policy not in POLICIES:
        raise typer.BadParameter(f"{policy!r}: one of {', '.join(POLICIES)}", param_hint="POLICY")
    if shutil.which(cmd[0]) is None:  # else every restart would fail the same way
        raise typer.BadParameter(f"{cmd[0]!r}: no such command", param_hint="CMD")
    raise typer.Exit(supervise(cmd, policy))
