"""compose's restart policies for local processes (infra/restart.py, used by `specloop up`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from infra.restart import supervise
from infra.topology import compose_service, specloop_command


def test_on_failure_restarts_until_the_command_succeeds(tmp_path):
    count = tmp_path / "runs"
    count.write_text("0")
    script = (f"import pathlib, sys; p = pathlib.Path({str(count)!r}); n = int(p.read_text()) + 1; "
              "p.write_text(str(n)); sys.exit(0 if n >= 3 else 1)")
    assert supervise([sys.executable, "-c", script], "on-failure", max_backoff_s=1.0) == 0
    assert count.read_text() == "3"


def test_no_policy_runs_once(tmp_path):
    assert supervise([sys.executable, "-c", "import sys; sys.exit(4)"], "no") == 4


def test_sigterm_stops_the_supervisor_and_its_command():
    probe = ("from infra.restart import supervise; import sys; "
             "sys.exit(supervise([sys.executable, '-c', 'import time; time.sleep(60)'], 'always'))")
    proc = subprocess.Popen([sys.executable, "-c", probe])
    time.sleep(1.5)  # the command is running
    children = [int(p) for p in os.listdir("/proc") if p.isdigit() and _ppid(int(p)) == proc.pid]
    assert children
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=10)  # it exits instead of restarting the command (TimeoutExpired otherwise)
    time.sleep(0.2)
    assert not [c for c in children if _alive(c)]


def test_compose_services_with_a_restart_policy_are_wrapped():
    cmd, _ = compose_service("trainer")
    assert cmd == ["specloop", "restart-policy", "unless-stopped", "--", "specloop", "train"]
    local = specloop_command(cmd)
    assert local[0] == local[4] and local[0].endswith("specloop") and local[1:4] == cmd[1:4]


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_bad_policy_or_a_missing_command_is_a_usage_error():
    from typer.testing import CliRunner

    from infra.cli import app

    for args, expected in ((["sometimes", "--", "true"], "'sometimes': one of no, on-failure"),
                           (["always", "--", "/no/such/command", "x"], "'/no/such/command': no such command")):
        result = CliRunner().invoke(app, ["restart-policy", *args])
        out = " ".join(result.output.replace("│", " ").split())
        assert result.exit_code == 2 and expected in out, out
        assert isinstance(result.exception, SystemExit)
