"""`specloop up` keeps a running replica or trainer only when it would start it the same way
(infra/topology.py): another model, suffix seed, shell or ``.env`` value restarts it and says what
changed, by name and never by value, as ``docker compose up`` recreates a changed container; one
recorded without its configuration (by an older specloop) is restarted too. Before, any healthy
process recorded under the name was kept: ``up --model B`` went on serving model A.

The processes are real stand-ins, started as docker-compose.yml's are (``specloop restart-policy``
over the command of a compose file of the test's own): "serving" answers ``/health`` with the model
it was given, "trainer" sleeps. They read no broker, Redis or MLflow, so ``start_processes`` (what
``up`` runs once the stack is up) is given an empty stack.
"""

from __future__ import annotations

import json
import sys
import urllib.request

import pytest
import yaml

from infra.processes import _group_members
from infra.stack import Stack, StackInfo
from infra.suffix_seed import SEED_ENV
from infra.topology import Topology

SERVER = """
import http.server, os
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(os.environ['SPECLOOP_MODEL'].encode())
    def log_message(self, *args):
        pass
http.server.HTTPServer(('127.0.0.1', int(os.environ['SPECLOOP_PORT'])), Health).serve_forever()
"""
ENV_FILE = [{"path": ".env", "required": False}]
SECRET = "sk-never-to-be-printed"


@pytest.fixture
def compose(tmp_path, monkeypatch):
    """A compose file whose serving and trainer are the stand-ins, in a directory for its ``.env``."""
    for name in ("SPECLOOP_K", "SPECLOOP_API_KEYS"):
        monkeypatch.delenv(name, raising=False)
    path = tmp_path / "compose" / "docker-compose.yml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump({"services": {
        "serving": {"command": [sys.executable, "-c", SERVER], "restart": "unless-stopped",
                    "env_file": ENV_FILE,
                    "environment": {"SPECLOOP_MODEL": "set by up", "SPECLOOP_PORT": "8000",
                                    "SPECLOOP_K": "${SPECLOOP_K:-4}",
                                    "SPECLOOP_API_KEYS": "${SPECLOOP_API_KEYS:-}"}},
        "trainer": {"command": [sys.executable, "-c", "import time; time.sleep(600)"],
                    "restart": "unless-stopped", "env_file": ENV_FILE,
                    "environment": {"SPECLOOP_MODEL": "set by up"}}}}))
    yield path
    Stack(tmp_path / "run").down()


def up(run_dir, compose, model: str, seed: str = "seed-640.jsonl", replicas: int = 1
       ) -> tuple[Topology, list[str], list[str]]:
    """One ``specloop up --replicas N``: (topology, replica URLs, what it said)."""
    said: list[str] = []
    topo = Topology(run_dir, replicas=replicas, model=model, extra_env={SEED_ENV: seed}, compose_file=compose)
    info = topo.start_processes(StackInfo(run_dir=str(run_dir)), said.append)
    return topo, info.replicas, said


def serving_model(url: str) -> str:
    with urllib.request.urlopen(f"{url}/health", timeout=10) as resp:
        return resp.read().decode()


def pids(topo: Topology) -> dict[str, int]:
    return {name: s.pid for name, s in topo.stack.info().services.items()}


def test_up_restarts_what_it_would_start_differently_and_keeps_the_rest(tmp_path, compose, monkeypatch):
    run = tmp_path / "run"
    topo, urls, said = up(run, compose, "model-a")
    first = pids(topo)
    assert said == [] and set(first) == {"serving-0", "trainer"} and serving_model(urls[0]) == "model-a"
    assert (run / "config-key").stat().st_mode & 0o777 == 0o600

    # The same configuration from a new shell (another TERM, another working directory): kept.
    monkeypatch.setenv("TERM", "another-terminal")
    monkeypatch.chdir(tmp_path)
    topo, again, said = up(run, compose, "model-a")
    assert said == [] and again == urls and pids(topo) == first

    # Another model: both restarted, saying so, and the replica serves the new one.
    topo, urls, said = up(run, compose, "model-b")
    assert said == ["serving-0: configuration changed (SPECLOOP_MODEL), restarting it",
                    "trainer: configuration changed (SPECLOOP_MODEL), restarting it"]
    second = pids(topo)
    assert serving_model(urls[0]) == "model-b"
    assert all(second[n] != first[n] and not _group_members(first[n]) for n in first)

    # A shell value compose interpolates, a secret in .env and another suffix seed: each process
    # names what changed for it (the trainer is given no SPECLOOP_K), and the secret appears
    # neither in what is said nor in the state file.
    monkeypatch.setenv("SPECLOOP_K", "6")
    (compose.parent / ".env").write_text(f"SPECLOOP_API_KEYS='{json.dumps({SECRET: 'acme'})}'\n")
    topo, urls, said = up(run, compose, "model-b", seed="seed-160.jsonl")
    assert said == [
        "serving-0: configuration changed (SPECLOOP_API_KEYS, SPECLOOP_K, SPECLOOP_SUFFIX_SEED_FILE), restarting it",
        "trainer: configuration changed (SPECLOOP_API_KEYS, SPECLOOP_SUFFIX_SEED_FILE), restarting it"]
    third = pids(topo)
    assert all(third[n] != second[n] for n in second) and serving_model(urls[0]) == "model-b"
    state = (run / "stack.json").read_text()
    assert SECRET not in state and "seed-160" not in state and "model-b" not in state

    # A replica recorded by an older specloop (no configuration in its record; the state file
    # still loads): restarted, saying why; the trainer, recorded with one, is kept.
    record = json.loads(state)
    del record["serving-0"]["config"]
    (run / "stack.json").write_text(json.dumps(record))
    topo, urls, said = up(run, compose, "model-b", seed="seed-160.jsonl")
    assert said == ["serving-0: recorded by an older specloop, without its configuration, restarting it"]
    fourth = pids(topo)
    assert fourth["serving-0"] != third["serving-0"] and fourth["trainer"] == third["trainer"]
    assert serving_model(urls[0]) == "model-b"


def test_up_with_fewer_replicas_stops_the_ones_beyond_them(tmp_path, compose):
    """As ``docker compose up --scale serving=1`` after 2: before, ``serving-1`` ran on."""
    run = tmp_path / "run"
    topo, urls, said = up(run, compose, "model-a", replicas=2)
    first = pids(topo)
    assert len(urls) == 2 and set(first) == {"serving-0", "serving-1", "trainer"}
    topo, again, said = up(run, compose, "model-a", replicas=1)
    assert said == ["serving-1: beyond --replicas 1, stopping it"] and again == urls[:1]
    assert pids(topo) == {n: first[n] for n in ("serving-0", "trainer")}
    assert not _group_members(first["serving-1"])
