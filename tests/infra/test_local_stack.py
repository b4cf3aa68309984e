"""The local stack launcher: real processes, stopped by pid, usable across shells."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infra.processes import _alive, _group_members
from infra.stack import Stack

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.3)
        return s.connect_ex(("127.0.0.1", port)) == 0


def specloop(*args: str) -> subprocess.CompletedProcess:
    """The CLI in a separate process, as a user's shell would run it."""
    return subprocess.run([sys.executable, "-c", "from infra.cli import app; app()", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=120, check=False)


def gone(service) -> bool:
    return not _alive(service.pid, service.start_time) and not _group_members(service.pid)


@pytest.mark.usefixtures("requires_tansu", "requires_redis")
def test_services_start_healthy_restart_on_same_port_and_stop_by_pid(private_stack: Stack):
    broker = private_stack.start_broker()
    redis = private_stack.start_redis()
    assert private_stack.status() == {"broker": True, "redis": True}
    info = private_stack.info()
    assert info.bootstrap_servers == broker.url and info.redis_url == redis.url
    assert info.env()["SPECLOOP_KAFKA_BOOTSTRAP_SERVERS"] == broker.url

    with pytest.raises(RuntimeError, match="already running"):
        private_stack.start_broker()

    assert private_stack.stop("broker")
    assert gone(broker) and not port_open(broker.port)
    assert private_stack.stop("broker") is False  # nothing left to stop
    again = private_stack.start_broker(port=broker.port)
    assert again.pid != broker.pid and port_open(broker.port)

    assert private_stack.down() == ["broker", "redis"]
    assert gone(again) and gone(redis) and not port_open(redis.port)


def test_stop_never_signals_a_recycled_pid(tmp_path):
    stack = Stack(tmp_path)
    sleeper = subprocess.Popen(["sleep", "30"], start_new_session=True)  # a group leader
    try:
        # A stale record: the pid is live but started at another time, i.e. it was reused.
        (tmp_path / "stack.json").write_text(json.dumps({"redis": {
            "name": "redis", "pid": sleeper.pid, "start_time": 1, "port": 1,
            "url": "redis://x", "log": "x", "cmd": ["redis-server"]}}))
        assert stack.service("redis") is None and stack.status() == {"redis": False}
        assert stack.stop("redis") is False
        time.sleep(0.1)
        assert sleeper.poll() is None  # untouched
        assert json.loads((tmp_path / "stack.json").read_text()) == {}  # stale record dropped
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.usefixtures("requires_tansu", "requires_redis")
def test_cli_up_status_down_from_separate_processes(tmp_path):
    run_dir = str(tmp_path / "cli-stack")
    up = specloop("stack", "up", "--services", "broker,redis", "--run-dir", run_dir, "--json")
    assert up.returncode == 0, up.stderr
    info = json.loads(up.stdout.strip().splitlines()[-1])
    broker_port = int(info["bootstrap_servers"].rsplit(":", 1)[1])
    redis_port = int(info["redis_url"].rsplit(":", 1)[1].split("/")[0])
    assert port_open(broker_port) and port_open(redis_port)
    state = json.loads((Path(run_dir) / "stack.json").read_text())
    assert set(state) == {"broker", "redis"}

    status = specloop("stack", "status", "--run-dir", run_dir)
    assert status.returncode == 0 and "broker  healthy" in status.stdout
    assert f"export SPECLOOP_REDIS_URL=redis://127.0.0.1:{redis_port}/0" in status.stdout

    again = specloop("stack", "up", "--services", "broker,redis", "--run-dir", run_dir, "--json")
    assert json.loads(again.stdout.strip().splitlines()[-1]) == info  # kept, not restarted

    down = specloop("stack", "down", "--run-dir", run_dir)
    assert down.returncode == 0 and "broker" in down.stdout
    deadline = time.monotonic() + 5
    while any(_group_members(s["pid"]) for s in state.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    for svc in state.values():
        assert not _alive(svc["pid"], svc["start_time"]) and not _group_members(svc["pid"])
    assert not port_open(broker_port) and not port_open(redis_port)
    assert specloop("stack", "status", "--run-dir", run_dir).stdout == ""  # nothing recorded


@pytest.mark.parametrize("command", [("stack", "down"), ("down",)])
def test_down_in_a_directory_with_no_stack_says_so_and_creates_nothing(tmp_path, command):
    """A mistyped --run-dir used to be created and answered "nothing was running", while the stack
    meant ran on elsewhere."""
    typo = tmp_path / "no-such-run"
    down = specloop(*command, "--run-dir", str(typo))
    assert down.returncode == 0, down.stderr
    assert f"no stack recorded in {typo}" in down.stdout
    assert not typo.exists()


@pytest.mark.usefixtures("requires_tansu", "requires_weed")
def test_s3_storage_keeps_messages_across_broker_restarts(private_stack: Stack):
    from kafka import KafkaConsumer, KafkaProducer, TopicPartition

    broker = private_stack.start_broker(storage="s3")
    assert private_stack.status() == {"s3": True, "broker": True}
    producer = KafkaProducer(bootstrap_servers=broker.url, acks="all")
    for i in range(5):
        producer.send("durable", key=b"k", value=f"m{i}".encode())
    producer.flush()
    producer.close()

    private_stack.stop("broker")
    private_stack.start_broker(port=broker.port, storage="s3")
    consumer = KafkaConsumer(bootstrap_servers=broker.url, enable_auto_commit=False)
    try:
        parts = consumer.partitions_for_topic("durable")
        consumer.assign([TopicPartition("durable", p) for p in parts])
        consumer.seek_to_beginning()
        values, deadline = [], time.monotonic() + 10
        while len(values) < 5 and time.monotonic() < deadline:
            values += [m.value for ms in consumer.poll(timeout_ms=300).values() for m in ms]
    finally:
        consumer.close()
    assert sorted(values) == [f"m{i}".encode() for i in range(5)]


def test_mlflow_server_tracks_runs_and_stores_artifacts(mlflow_server, tmp_path):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_server.url)
    exp = client.create_experiment(f"stack-smoke-{time.time_ns()}")
    run = client.create_run(exp)
    client.log_metric(run.info.run_id, "acceptance", 0.42)
    artifact = tmp_path / "weights.txt"
    artifact.write_text("not really weights")
    client.log_artifact(run.info.run_id, str(artifact))  # through the server's artifact proxy
    client.set_terminated(run.info.run_id)
    got = client.get_run(run.info.run_id)
    assert got.data.metrics["acceptance"] == pytest.approx(0.42)
    assert [f.path for f in client.list_artifacts(run.info.run_id)] == ["weights.txt"]
    stored = list(Path(mlflow_server.log).parent.glob("mlflow/artifacts/**/weights.txt"))
    assert len(stored) == 1
