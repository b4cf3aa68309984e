"""Drafter registry on MLflow: every candidate a run, promoted ones registered versions per tenant.

Layout: one experiment per target fingerprint (``specloop/<fingerprint key>``); a run per candidate
with loss curves, gate metrics and lineage params; the drafter directory written by
feedback/registry/artifact.py (config + safetensors + fingerprint + checksum; no pickle) logged as the run's
``drafter`` artifact; registered model ``specloop-drafter-<tenant>`` whose versions point at that
artifact path; alias ``champion`` on the live one. ``load_champion`` downloads by alias and validates
through ``feedback.registry.artifact.load_drafter`` (fingerprint, config, checksum, finite weights).
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from feedback.target.fingerprint import TargetFingerprint

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

MLFLOW_HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
"""The MLflow client retries a dead server for minutes per call by default (7 retries, 120 s
timeout); serving's Swapper and the trainer retry on their own. An operator's own setting wins."""


def use_short_mlflow_http_retries() -> None:
    """Set ``MLFLOW_HTTP_DEFAULTS`` where unset (MLflow reads them per request). Done when this
    module is imported: the registry path of both serving and the trainer."""
    for name, value in MLFLOW_HTTP_DEFAULTS.items():
        os.environ.setdefault(name, value)


use_short_mlflow_http_retries()

CHAMPION = "champion"
ARTIFACT_PATH = "drafter"


class RegistryError(RuntimeError):
    """The registry has no usable drafter for the request (absent, wrong target, corrupt)."""


def model_name(tenant: str) -> str:
    return f"specloop-drafter-{tenant}"


LIVE_METRIC = "live_accept_len"


def live_metric_key(replica_id: str | None) -> str:
    """``live_accept_len.<replica id>`` (characters MLflow refuses in a key become "_"), or
    ``live_accept_len`` for a writer that names no replica."""
    if not replica_id:
        return LIVE_METRIC
    return f"{LIVE_METRIC}.{re.sub(r'[^A-Za-z0-9_.-]', '_', replica_id)}"


@dataclass
class RegisteredDrafter:
    name: str
    version: str
    run_id: str
    source: str


class DrafterRegistry:
    def __init__(self, tracking_uri: str, artifact_root: str | None = None):
        """``tracking_uri``: ``sqlite:///path.db`` or ``http://host:port``. For sqlite, artifacts go to
        ``artifact_root`` (default: an ``artifacts`` folder beside the database file)."""
        from mlflow.tracking import MlflowClient

        self.tracking_uri = tracking_uri
        if artifact_root is None and tracking_uri.startswith("sqlite:///"):
            artifact_root = str(Path(tracking_uri.removeprefix("sqlite:///")).parent / "artifacts")
        self.artifact_root = artifact_root
        self.client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)

    # -- runs -------------------------------------------------------------------------------
    def experiment_id(self, fingerprint: TargetFingerprint) -> str:
        name = f"specloop/{fingerprint.key()}"
        exp = self.client.get_experiment_by_name(name)
        if exp is not None:
            return exp.experiment_id
        location = None
        if self.artifact_root is not None:
            location = Path(self.artifact_root, fingerprint.key()).resolve().as_uri()
        return self.client.create_experiment(name, artifact_location=location, tags={
            "target_model_id": fingerprint.model_id, "tokenizer_hash": fingerprint.tokenizer_hash,
            "vocab_size": str(fingerprint.vocab_size)})

    def log_candidate(
        self,
        fingerprint: TargetFingerprint,
        artifact_dir: str | Path,
        *,
        params: dict | None = None,
        metrics: dict[str, float] | None = None,
        curves: dict[str, list[tuple[int, float]]] | None = None,
        tags: dict[str, str] | None = None,
    ) -> str:
        """One finished candidate -> a run (params = lineage + loss config); returns its run id."""
        from mlflow.entities import Metric, Param, RunTag

        run = self.client.create_run(self.experiment_id(fingerprint), tags={
            "target_fingerprint": fingerprint.key(), **(tags or {})})
        rid = run.info.run_id
        now = int(time.time() * 1000)
        ms = [Metric(k, float(v), now, 0) for k, v in (metrics or {}).items()]
        for key, points in (curves or {}).items():
            ms += [Metric(key, float(v), now, int(step)) for step, v in points]
        ps = [Param(k, str(v)[:6000]) for k, v in (params or {}).items()]
        for i in range(0, max(len(ms), 1), 900):  # MLflow caps a batch at 1000 metrics
            self.client.log_batch(rid, metrics=ms[i:i + 900], params=ps if i == 0 else [],
                                  tags=[RunTag("target_model_id", fingerprint.model_id)] if i == 0 else [])
        self.client.log_artifacts(rid, str(artifact_dir), artifact_path=ARTIFACT_PATH)
        self.client.set_terminated(rid)
        return rid

    # -- versions ---------------------------------------------------------------------------
    def register(self, tenant: str, run_id: str, *, champion: bool = True, description: str = "") -> RegisteredDrafter:
        """Register the run's drafter artifact as a new version of the tenant's model."""
        from mlflow.exceptions import MlflowException

        name = model_name(tenant)
        try:
            self.client.create_registered_model(name, description=f"speculative drafter for tenant {tenant}")
        except MlflowException as e:
            if "already exists" not in str(e).lower() and "RESOURCE_ALREADY_EXISTS" not in str(e):
                raise
        source = f"{self.client.get_run(run_id).info.artifact_uri}/{ARTIFACT_PATH}"
        mv = self.client.create_model_version(name, source=source, run_id=run_id, description=description)
        if champion:
            self.client.set_registered_model_alias(name, CHAMPION, mv.version)
        return RegisteredDrafter(name, str(mv.version), run_id, source)

    def set_champion(self, tenant: str, version: str) -> None:
        self.client.set_registered_model_alias(model_name(tenant), CHAMPION, str(version))

    def clear_champion(self, tenant: str) -> None:
        """Take the ``champion`` alias off whichever version has it: the tenant is back on a drafter
        the registry does not hold (serving's day-0 one), and ``champion`` reads None. Nothing to do
        when the alias or the model is absent."""
        from mlflow.exceptions import MlflowException

        try:
            self.client.delete_registered_model_alias(model_name(tenant), CHAMPION)
        except MlflowException as e:
            if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise

    def champion(self, tenant: str) -> RegisteredDrafter | None:
        """The tenant's champion version, or None when it has none. Raises MlflowException when the
        registry cannot say (unreachable)."""
        from mlflow.exceptions import MlflowException

        try:
            mv = self.client.get_model_version_by_alias(model_name(tenant), CHAMPION)
        except MlflowException as e:
            if e.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
                return None  # no such model, or no alias on it
            raise  # the registry is down: not the same as "no champion"
        return RegisteredDrafter(mv.name, str(mv.version), mv.run_id, mv.source)

    def download(self, tenant: str, version: str | None = None, dst: str | Path | None = None) -> tuple[Path, RegisteredDrafter]:
        """Download a version (default: the champion) into ``dst`` (default: a fresh temp dir)."""
        import mlflow.artifacts

        if version is None:
            reg = self.champion(tenant)
            if reg is None:
                raise RegistryError(f"tenant {tenant!r} has no {CHAMPION!r} drafter in {self.tracking_uri}")
        else:
            mv = self.client.get_model_version(model_name(tenant), str(version))
            reg = RegisteredDrafter(mv.name, str(mv.version), mv.run_id, mv.source)
        dst = Path(dst or tempfile.mkdtemp(prefix=f"specloop-{tenant}-v{reg.version}-"))
        path = mlflow.artifacts.download_artifacts(artifact_uri=reg.source, dst_path=str(dst),
                                                   tracking_uri=self.tracking_uri)
        return Path(path), reg

    def load_champion(self, tenant: str, expected_fingerprint: TargetFingerprint, dst: str | Path | None = None,
                      target_tensors=None):
        """Download the champion and validate it; returns whatever ``feedback.registry.artifact.load_drafter``
        returns (``target_tensors``: the target's, for an artifact that leaves some to it). Raises
        RegistryError with the reason when it is absent or fails validation."""
        from feedback.registry.artifact import load_drafter

        path, reg = self.download(tenant, None, dst)
        try:
            return load_drafter(path, expected_fingerprint=expected_fingerprint, target_tensors=target_tensors)
        except Exception as e:  # the artifact module's own errors: fingerprint, checksum, NaN...
            raise RegistryError(f"champion {reg.name} v{reg.version} refused: {e}") from e

    # -- serving feedback --------------------------------------------------------------------
    def log_live_acceptance(self, tenant: str, version: str, value: float, step: int,
                            replica_id: str | None = None) -> None:
        """Live acceptance of a deployed version (the EMA of tokens per verify step and row), logged
        on the run that produced it under ``live_metric_key(replica_id)``: one curve per replica,
        ``step`` being that replica's verify steps of the version."""
        mv = self.client.get_model_version(model_name(tenant), str(version))
        self.client.log_metric(mv.run_id, live_metric_key(replica_id), float(value), step=int(step))

    def log_version_metrics(self, tenant: str, version: str, metrics: dict[str, float]) -> None:
        """Metrics of a deployed version measured by serving (its freshness at its first swap after
        the promotion, the rollback watch's verdict), logged on the run that produced it."""
        from mlflow.entities import Metric

        mv = self.client.get_model_version(model_name(tenant), str(version))
        now = int(time.time() * 1000)
        self.client.log_batch(mv.run_id, metrics=[Metric(k, float(v), now, 0) for k, v in metrics.items()])

    def log_event(self, tenant: str, version: str, event: str, at: float | None = None) -> None:
        """Swap/rollback events, as tags on the version (operators see them in the UI), keyed by
        when they happened (``at``, epoch seconds; default now) to the millisecond."""
        at = time.time() if at is None else at
        self.client.set_model_version_tag(model_name(tenant), str(version), f"event.{int(at * 1000)}", event)
