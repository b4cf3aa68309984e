"""`specloop up` reads docker-compose.yml as compose does: ``${NAME:-default}`` takes NAME from the
shell, else from the ``.env`` next to the file, else the default (infra/topology.py)."""

from __future__ import annotations

import json
import shutil

import pytest

from infra.topology import COMPOSE_FILE, Topology, compose_environment, compose_service, interpolate


@pytest.fixture
def compose_dir(tmp_path):
    """A copy of docker-compose.yml in a directory of its own, for a ``.env`` next to it."""
    shutil.copy(COMPOSE_FILE, tmp_path / "docker-compose.yml")
    return tmp_path


def _env(compose_dir, service: str, shell: dict[str, str]) -> dict[str, str]:
    path = compose_dir / "docker-compose.yml"
    return compose_service(service, path, env=compose_environment(path, environ=shell))[1]


def test_unset_variables_keep_compose_defaults(compose_dir):
    env = _env(compose_dir, "serving", {})
    assert env["SPECLOOP_K"] == "4" and env["SPECLOOP_DEV_MODE"] == "0"
    assert env["SPECLOOP_API_KEYS"] == "" and env["SPECLOOP_ADMIN_TOKEN"] == "change-me"


def test_a_dotenv_value_overrides_the_default(compose_dir):
    keys = json.dumps({"a-long-random-key": "acme"})
    (compose_dir / ".env").write_text(f"SPECLOOP_K=6\nSPECLOOP_DEV_MODE=1\nSPECLOOP_API_KEYS='{keys}'\n")
    serving, trainer = _env(compose_dir, "serving", {}), _env(compose_dir, "trainer", {})
    assert serving["SPECLOOP_K"] == trainer["SPECLOOP_TRAINER_K"] == "6"
    assert serving["SPECLOOP_DEV_MODE"] == trainer["SPECLOOP_DEV_MODE"] == "1"
    assert json.loads(serving["SPECLOOP_API_KEYS"]) == {"a-long-random-key": "acme"}  # quotes intact
    assert serving["SPECLOOP_ADMIN_TOKEN"] == "change-me"  # not in .env: still the default


def test_dotenv_settings_reach_serving_and_the_trainer_whole(compose_dir, monkeypatch):
    """The docker README says every setting goes in .env: compose interpolates only the names it
    uses, so the file also reaches both containers as their env_file (what `environment:` sets
    wins); a tenant set there reaches serving and the trainer alike."""
    from serving.config import ServingSettings
    from trainer.config import TrainerSettings

    (compose_dir / ".env").write_text("SPECLOOP_MAX_BATCH_SIZE=16\nSPECLOOP_TRAINER_LR=0.0007\n"
                                      "SPECLOOP_TENANT=acme\nSPECLOOP_DRAFTER_DIR=/elsewhere\n")
    serving, trainer = _env(compose_dir, "serving", {}), _env(compose_dir, "trainer", {})
    assert serving["SPECLOOP_DRAFTER_DIR"] == "/models/draft"  # compose's own setting wins
    for k in [k for k in __import__("os").environ if k.startswith("SPECLOOP_")]:
        monkeypatch.delenv(k)
    for k, v in {**serving, "SPECLOOP_ADMIN_TOKEN": "an-operator-chosen-token"}.items():
        monkeypatch.setenv(k, v)
    s = ServingSettings()
    assert (s.max_batch_size, s.tenant) == (16, "acme")
    for k in serving:
        monkeypatch.delenv(k, raising=False)
    for k, v in trainer.items():
        monkeypatch.setenv(k, v)
    t = TrainerSettings()
    assert (t.lr, t.tenant) == (0.0007, "acme")


def test_without_a_dotenv_the_services_keep_compose_environment(compose_dir):
    serving = _env(compose_dir, "serving", {})
    assert "SPECLOOP_MAX_BATCH_SIZE" not in serving and serving["SPECLOOP_TENANT"] == "default"


def test_a_shell_value_overrides_dotenv(compose_dir):
    (compose_dir / ".env").write_text("SPECLOOP_K=6\n")
    assert _env(compose_dir, "serving", {"SPECLOOP_K": "7"})["SPECLOOP_K"] == "7"
    assert _env(compose_dir, "serving", {"SPECLOOP_K": ""})["SPECLOOP_K"] == "4"  # :- treats empty as unset


def test_only_the_forms_the_file_uses_are_interpolated():
    assert interpolate("a ${X:-1} $$b", {"X": "2"}) == "a 2 $b"
    assert interpolate({"k": ["${X:-1}", 3]}) == {"k": ["1", 3]}
    assert interpolate("$${X:-1}", {"X": "2"}) == "${X:-1}"  # escaped: left for the shell
    for unsupported in ("${X}", "${X-1}", "${X:?missing}", "$X"):
        with pytest.raises(ValueError, match="only"):
            interpolate(unsupported, {"X": "2"})


def test_an_operator_admin_token_is_used_instead_of_a_generated_one(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECLOOP_ADMIN_TOKEN", "an-operator-chosen-token")
    assert Topology(tmp_path / "run").admin_token() == "an-operator-chosen-token"
    assert not (tmp_path / "run" / "admin-token").exists()
    topo = Topology(tmp_path / "run")
    topo.compose_env = {}  # none set: generated once per run directory
    token = topo.admin_token()
    assert token != "an-operator-chosen-token" and token == topo.admin_token()
    assert (tmp_path / "run" / "admin-token").stat().st_mode & 0o777 == 0o600


def test_specloop_up_leaves_the_trainer_device_to_the_machine(compose_dir):
    """Compose trains on the GPU it reserves (SPECLOOP_TRAINER_DEVICE=cuda); `specloop up` runs its
    topology for a user without GPUs, so the trainer there trains where it sees one (auto): with
    compose's cuda, a CPU machine's trainer refused to start."""
    from infra.stack import StackInfo
    from infra.topology import local_env

    trainer = _env(compose_dir, "trainer", {})
    assert trainer["SPECLOOP_TRAINER_DEVICE"] == "cuda"
    stack = StackInfo(run_dir=str(compose_dir), bootstrap_servers="127.0.0.1:1", redis_url="redis://127.0.0.1:2",
                      mlflow_uri="http://127.0.0.1:3")
    assert "SPECLOOP_TRAINER_DEVICE" not in local_env(trainer, stack, None)
