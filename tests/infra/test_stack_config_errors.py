"""Bad configuration of the local stack is one line on stderr and exit 1, never a traceback: an
invalid ``SPECLOOP_STACK_*`` variable names the variable; a corrupt or truncated state file
(``stack.json``) names the file, what may still run and how to stop it, and is left as it was
(infra/stack_cli.py, infra/topology.py). Before, pydantic's ValidationError and json's
JSONDecodeError reached the user as tracebacks."""

from __future__ import annotations

import subprocess

import pytest
from typer.testing import CliRunner

from infra.cli import app

COMMANDS = {
    "stack up": ["stack", "up", "--services", "redis"],
    "stack status": ["stack", "status"],
    "stack down": ["stack", "down"],
    "up": ["up", "--suffix-seed", "0"],  # --model: an existing directory (the check is before ours)
    "down": ["down"],
}
CORRUPT = {
    "truncated": '{"broker": {"name": "broker", "pid": 4',
    "empty": "",
    "a list": "[1, 2]",
    "a service of the wrong shape": '{"broker": {"pid": "not a pid"}}',
}


def invoke(tmp_path, command: str, env: dict[str, str] | None = None):
    args = [*COMMANDS[command], "--run-dir", str(tmp_path / "run")]
    if command == "up":
        args += ["--model", str(tmp_path)]
    return CliRunner().invoke(app, args, env=env)


def one_line_error(out) -> str:
    """The single line a failed command wrote to stderr (exit 1, no exception of its own)."""
    assert isinstance(out.exception, SystemExit) and out.exit_code == 1, (out.exception, out.output)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), out.stderr
    return lines[0]


@pytest.mark.parametrize("command", COMMANDS)
def test_an_invalid_stack_variable_is_named_in_one_line(tmp_path, command):
    run = tmp_path / "run"
    run.mkdir()
    (run / "stack.json").write_text("{}")  # a stack recorded there, so every command reads its settings
    out = invoke(tmp_path, command, env={"SPECLOOP_STACK_STORAGE": "disk"})
    line = one_line_error(out)
    assert "SPECLOOP_STACK_STORAGE" in line and "'disk'" in line and "unset it" in line, line
    assert sorted(p.name for p in run.iterdir()) == ["stack.json"]  # nothing started


@pytest.mark.parametrize("content", CORRUPT.values(), ids=CORRUPT.keys())
@pytest.mark.parametrize("command", COMMANDS)
def test_a_corrupt_state_file_is_one_line_and_left_as_it_was(tmp_path, command, content):
    run = tmp_path / "run"
    run.mkdir()
    state = run / "stack.json"
    state.write_text(content)
    line = one_line_error(invoke(tmp_path, command))
    assert f"{state} is corrupt" in line and f"remove {state.name}" in line, line
    assert state.read_text() == content  # neither removed nor rewritten
    assert not any(p.suffix == ".log" for p in run.iterdir())  # nothing started


@pytest.mark.parametrize("command", ["stack down", "down"])
def test_a_corrupt_state_file_names_what_still_writes_to_the_run_directory(tmp_path, command):
    """The state file was the record of what runs; the processes still writing to the run
    directory's logs are what it recorded: named (process group, log), and left running."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "stack.json").write_text("{")
    with open(run / "serving-0.log", "ab") as log:
        replica = subprocess.Popen(["sleep", "30"], stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    try:
        line = one_line_error(invoke(tmp_path, command))
        assert f"process groups {replica.pid} (serving-0.log)" in line and "kill -- -PGID" in line, line
        assert replica.poll() is None  # not stopped on a guess
    finally:
        replica.kill()
        replica.wait()
