"""`specloop stack up` keeps a running service only when it would start it the same way, as `specloop
up` does for its replicas and trainer (infra/process_config.py, ``Stack.keep``): a broker started
with another storage, or on an S3 store that has moved, is restarted, saying what changed. Before,
any live broker was kept: `stack up --storage s3` after `--storage memory` went on keeping the
traces in memory."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from infra.processes import _group_members
from infra.stack import Stack

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("requires_tansu", "requires_weed")]


@pytest.fixture
def run(tmp_path):
    run = tmp_path / "stack"
    yield run
    Stack(run).down()


def stack_up(run, storage: str) -> tuple[list[str], int]:
    """``specloop stack up --services broker --storage STORAGE --json``: (what it said, broker pid)."""
    from infra.cli import app

    out = CliRunner().invoke(app, ["stack", "up", "--services", "broker", "--storage", storage,
                                   "--run-dir", str(run), "--json"])
    assert out.exit_code == 0, out.output + (out.stderr or "")
    info = json.loads(out.stdout.strip().splitlines()[-1])  # --json: stdout stays one object
    broker = Stack(run).service("broker")
    assert broker is not None and info["bootstrap_servers"] == broker.url
    return out.stderr.strip().splitlines(), broker.pid


def test_stack_up_restarts_a_broker_started_another_way_and_keeps_an_unchanged_one(run):
    said, first = stack_up(run, "memory")
    assert said == []
    said, again = stack_up(run, "memory")
    assert said == [] and again == first  # same configuration: kept

    said, second = stack_up(run, "s3")
    assert len(said) == 1 and said[0].startswith("broker: configuration changed (") and "command" in said[0]
    assert said[0].endswith(", restarting it") and second != first
    assert not _group_members(first)  # the old broker's whole process group is gone
    record = Stack(run).recorded()
    assert "s3://tansu/" in record["broker"].cmd and "s3" in Stack(run).info().services

    # The S3 store it wrote to is gone (stopped, or restarted on another port): the broker follows.
    Stack(run).stop("s3")
    said, third = stack_up(run, "s3")
    assert said == ["broker: configuration changed (AWS_ENDPOINT), restarting it"] and third != second
    assert Stack(run).recorded()["broker"].config["AWS_ENDPOINT"] != record["broker"].config["AWS_ENDPOINT"]

    # One recorded by an older specloop, without its configuration: restarted too.
    state = json.loads((run / "stack.json").read_text())
    del state["broker"]["config"]
    (run / "stack.json").write_text(json.dumps(state))
    said, fourth = stack_up(run, "s3")
    assert said == ["broker: recorded by an older specloop, without its configuration, restarting it"]
    assert fourth != third
