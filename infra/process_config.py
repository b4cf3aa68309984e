"""What defines a process specloop keeps running, recorded with it in ``stack.json``: a second ``up``
restarts a running process whose definition changed, as ``docker compose up`` recreates a changed
container. ``specloop up``'s replicas and trainer (infra/topology.py) and the stack's own services
(broker, Redis, MLflow, S3: infra/stack.py, ``Stack.keep``) are compared this way."""

from __future__ import annotations

import contextlib
import hmac
import os
import secrets
from collections.abc import Mapping
from pathlib import Path

PER_START = ("SPECLOOP_PORT",)
"""What ``up`` assigns anew at each start (a free port): not part of a process's configuration."""
COMMAND = "command"
"""The command's entry in a configuration (the rest are variable names)."""
KEY_FILE = "config-key"


def configuration(key: bytes, cmd: list[str], env: Mapping[str, str]) -> dict[str, str]:
    """What defines a process ``up`` starts: its command and each variable ``up`` gives it (compose's
    environment, the stack's addresses, ``extra_env``, ...; not the shell's own environment it
    inherits, nor ``PER_START``), each as a digest keyed by the run directory's ``config-key``:
    which part changed can be told, and no value, secrets included, can be read or guessed from
    the state file."""
    parts = {COMMAND: "\0".join(cmd), **{k: v for k, v in env.items() if k not in PER_START}}
    return {name: hmac.new(key, f"{name}={value}".encode(), "sha256").hexdigest()[:24]
            for name, value in parts.items()}


def changed(recorded: dict[str, str] | None, now: dict[str, str]) -> str | None:
    """Why a process recorded with configuration ``recorded`` must be started again for ``now``;
    None when the two are the same. Names what changed, never a value."""
    if recorded is None:
        return "recorded by an older specloop, without its configuration"
    names = sorted(n for n in recorded.keys() | now.keys() if recorded.get(n) != now.get(n))
    return f"configuration changed ({', '.join(names)})" if names else None


def config_key(run_dir: Path) -> bytes:
    """The run directory's key for ``configuration``'s digests (written once, mode 0600)."""
    return secret_file(run_dir / KEY_FILE, lambda: secrets.token_hex(32)).encode()


def secret_file(path: Path, make) -> str:
    """``path``'s content, written once with ``make()`` (mode 0600 from its creation on)."""
    with contextlib.suppress(FileExistsError):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(make())
    return path.read_text().strip()
