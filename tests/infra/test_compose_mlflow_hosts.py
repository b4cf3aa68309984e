"""Compose's MLflow server answers serving and the trainer, which call it as ``mlflow:5000``.

MLflow 3 refuses (403) every API request whose Host header is not in ``--allowed-hosts`` (default:
localhost and private IPs), while ``/health`` stays open: without the flag compose's stack looked
healthy and no version could ever be registered or downloaded. Here a real ``mlflow server`` (on
sqlite instead of PostgreSQL) runs with the flags compose gives it, and is called with the Host
header the containers send."""

from __future__ import annotations

import http.client
import os
import subprocess
import sys
import time
from urllib.parse import urlsplit

import pytest
import yaml

from infra.stack import free_port
from infra.topology import COMPOSE_FILE, interpolate


def _compose() -> dict:
    return yaml.safe_load(interpolate(COMPOSE_FILE.read_text()))


def _allowed_hosts_flag(compose: dict) -> str:
    flags = [a for a in compose["services"]["mlflow"]["command"] if a.startswith("--allowed-hosts=")]
    assert len(flags) == 1, "compose's mlflow command needs one --allowed-hosts"
    return flags[0]


def _status(port: int, host_header: str, path: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path, headers={"Host": host_header})
        return conn.getresponse().status
    finally:
        conn.close()


@pytest.fixture(scope="module")
def mlflow_as_compose_runs_it(tmp_path_factory):
    data = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
           "--backend-store-uri", f"sqlite:///{data / 'mlflow.db'}",
           "--artifacts-destination", str(data / "artifacts"), "--workers", "1",
           _allowed_hosts_flag(_compose())]
    env = dict(os.environ, MLFLOW_DISABLE_TELEMETRY="true", MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if _status(port, "localhost", "/health") == 200:
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mlflow server did not start: {proc.stderr.read().decode()[-2000:]}")
            time.sleep(0.5)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_the_containers_tracking_uri_is_an_allowed_host(mlflow_as_compose_runs_it):
    compose = _compose()
    uris = {compose["services"][s]["environment"]["SPECLOOP_MLFLOW_TRACKING_URI"] for s in ("serving", "trainer")}
    assert len(uris) == 1
    netloc = urlsplit(uris.pop()).netloc  # mlflow:5000, the Host header a container sends
    api = "/api/2.0/mlflow/experiments/search?max_results=1"
    assert _status(mlflow_as_compose_runs_it, netloc, api) == 200
    assert _status(mlflow_as_compose_runs_it, "localhost:5000", api) == 200  # the UI from the host


def test_other_host_headers_are_still_refused(mlflow_as_compose_runs_it):
    """The guard stays on: a name outside the list (DNS rebinding) gets 403."""
    api = "/api/2.0/mlflow/experiments/search?max_results=1"
    assert _status(mlflow_as_compose_runs_it, "attacker.example:5000", api) == 403
