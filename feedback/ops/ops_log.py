"""OpsRun: an MLflow run that operators read over time, written off the hot path.

Serving replicas and trainers each keep one (``role`` tag: serving | trainer) in the experiment of
their target, ``specloop/<target key>`` (where the trainer's candidate runs and the registered
versions already live), named ``<role>-<tenant>-<replica>``. Metrics are queued and a background
thread sends them in batches (``MlflowClient.log_batch``) every ``flush_s``; events (swaps,
rollbacks, gate decisions, drift) are metrics ``event.<name>`` (a count over time, so they plot as
steps) plus a tag holding the latest one's details.

Nothing here may fail the caller: a full queue drops and counts, an MLflow outage is logged, counted
(``errors``) and retried with the next batch (metrics are re-queued once), and ``close`` waits at
most ``close_timeout_s``. MLflow unreachable when the process starts: ``open_run_or_later`` gives a
``PendingRun``, which opens the run once MLflow answers.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import posixpath
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from feedback.background.supervise import Backoff
from feedback.registry.drafter_registry import use_short_mlflow_http_retries

log = logging.getLogger(__name__)

# MLflow prints "View run ... at: URL" on stdout when a run over HTTP ends; our CLIs and benchmarks
# print one JSON object there. The demo prints the operator's URL itself.
os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
# ... and the MLflow client's short HTTP retries, as on the registry path (a run opened before any
# DrafterRegistry, or without one, would otherwise retry a dead server for minutes per batch).
use_short_mlflow_http_retries()


@dataclass
class _Item:
    key: str
    value: float
    step: int
    ts_ms: int


class OpsRun:
    def __init__(
        self,
        tracking_uri: str,
        experiment: str,
        run_name: str,
        *,
        tags: dict[str, str] | None = None,
        params: dict[str, object] | None = None,
        flush_s: float = 2.0,
        max_queue: int = 20_000,
        close_timeout_s: float = 10.0,
    ):
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=tracking_uri)
        self.tracking_uri = tracking_uri
        self.flush_s = flush_s
        self.close_timeout_s = close_timeout_s
        self.dropped = 0
        self.errors = 0
        self.sent = 0
        self._events: dict[str, int] = {}
        self._queue: queue.Queue[_Item] = queue.Queue(max_queue)
        self._tags: dict[str, str] = {}
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()  # one sender at a time: the thread, or a caller's flush()
        self._stop = threading.Event()
        exp = self.client.get_experiment_by_name(experiment)
        self.experiment_id = exp.experiment_id if exp else self.client.create_experiment(experiment)
        run = self.client.create_run(
            self.experiment_id, run_name=run_name, tags={k: str(v) for k, v in (tags or {}).items()}
        )
        self.run_id = run.info.run_id
        if params:
            from mlflow.entities import Param

            self.client.log_batch(
                self.run_id, params=[Param(k, str(v)[:500]) for k, v in params.items()]
            )
        self._thread = threading.Thread(target=self._loop, name=f"ops-{run_name}", daemon=True)
        self._thread.start()

    # ---- what callers use ----------------------------------------------------------------------
    def metrics(self, values: dict[str, float], step: int = 0) -> None:
        ts = int(time.time() * 1000)
        for key, value in values.items():
            if value is None:
                continue
            try:
                self._queue.put_nowait(_Item(_clean(key), float(value), int(step), ts))
            except queue.Full:
                self.dropped += 1

    def event(self, name: str, step: int = 0, **details) -> None:
        """Count ``name`` (metric ``event.<name>``) and keep its latest details as a tag."""
        with self._lock:
            n = self._events[name] = self._events.get(name, 0) + 1
            self._tags[f"last_{name}"] = json.dumps(details, default=str)[:4000]
        self.metrics({f"event.{name}": n}, step)

    def tag(self, key: str, value: str) -> None:
        with self._lock:
            self._tags[key] = str(value)[:4000]

    def flush(self) -> None:
        """Send what is queued now (e.g. before a process is stopped), instead of at the next tick."""
        for _ in range(1 + self._queue.qsize() // 1000):  # batches of at most 1000; no retry loop
            self._flush()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(self.close_timeout_s)
        try:
            self.client.set_terminated(self.run_id)
        except Exception:
            log.warning("ops run %s: could not close the MLflow run", self.run_id, exc_info=True)

    # ---- background sender -----------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.wait(self.flush_s):
            self._flush()
        self._flush()

    def _flush(self) -> None:
        with self._send_lock:
            self._send()

    def _send(self) -> None:
        from mlflow.entities import Metric, RunTag

        items: list[_Item] = []
        while len(items) < 1000:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                break
        with self._lock:
            tags, self._tags = self._tags, {}
        if not items and not tags:
            return
        try:
            self.client.log_batch(
                self.run_id,
                metrics=[Metric(i.key, i.value, i.ts_ms, i.step) for i in items],
                tags=[RunTag(k, v) for k, v in tags.items()],
            )
            self.sent += len(items)
        except Exception:
            self.errors += 1
            if self.errors <= 5 or self.errors % 100 == 0:
                log.warning("ops run %s: MLflow unreachable (%d errors)", self.run_id, self.errors,
                            exc_info=True)
            for i in items:  # once more with the next batch; what does not fit is dropped
                try:
                    self._queue.put_nowait(i)
                except queue.Full:
                    self.dropped += 1
            with self._lock:
                self._tags = {**tags, **self._tags}


def _clean(key: str) -> str:
    """``key`` as an MLflow metric name: alphanumerics, _ - . / and spaces, at most 250 characters,
    and no path that MLflow would read as another name (``x/``, ``a//b``, ``a/../b``: it refuses the
    whole batch). A key that needs no change is kept; a changed one ends in a short hash of the
    original, so that client domains that clean alike (``a?b``, ``a!b``) stay apart, not one series.
    The hash covers the original from the dot-separated part where the change begins: one domain's
    keys (``acceptance.<domain>``, ``tokens_per_verify.<domain>``) carry the same one."""
    cleaned = "".join(c if c.isalnum() or c in "_-./ " else "_" for c in key)
    if posixpath.normpath(cleaned) != cleaned or cleaned.startswith(("/", "..")):
        cleaned = cleaned.replace("/", "_")
    if cleaned == key and len(key) <= 250:
        return key
    first = next((i for i, (a, b) in enumerate(zip(key, cleaned)) if a != b), 243)
    part = cleaned.rfind(".", 0, min(first, 243)) + 1
    return f"{cleaned[:243]}-{hashlib.sha256(key[part:].encode()).hexdigest()[:6]}"


class PendingRun:
    """The ops run of a process whose MLflow was unreachable when it started: it opens itself once
    MLflow answers (before, such a process recorded nothing until it was restarted).

    ``opener`` (which makes the OpsRun, raising while MLflow is away) is retried on a daemon thread
    of its own, ``retry_initial_s`` after the start, then doubling up to ``retry_max_s``; callers
    never wait on it (before the run is open their calls only touch memory, after it they go to the
    OpsRun, whose own thread sends). Not a SupervisedThread: its loop being "down" would turn
    serving's ``/health`` to 503 over an MLflow outage, while the replica serves fine.

    Before the run is open, metric points are dropped and counted in ``dropped`` (the outage shows
    as a gap, as for an outage later in a run's life, not as a partial replay); tags and event
    counts, which are state rather than time series, are kept (latest value per key) and set on the
    run when it opens, so ``live_drafter`` and the ``event.<name>`` totals are right from then on.
    ``run_id`` is None until then; ``close`` closes the run, or stops the retries."""

    def __init__(self, opener: Callable[[], OpsRun], name: str = "ops", *,
                 retry_initial_s: float = 5.0, retry_max_s: float = 300.0):
        self.name = name
        self.run: OpsRun | None = None
        """The real run, once open."""
        self.attempts = 0
        self._opener = opener
        self._dropped = 0
        self._failed = 0
        self._events: dict[str, int] = {}
        self._tags: dict[str, str] = {}
        self._step = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._backoff = Backoff(initial_s=retry_initial_s, max_s=retry_max_s)
        self._thread = threading.Thread(target=self._retry, name=f"ops-open-{name}", daemon=True)
        self._thread.start()

    # ---- the OpsRun interface ---------------------------------------------------------------------
    @property
    def run_id(self) -> str | None:
        run = self.run
        return run.run_id if run is not None else None

    @property
    def dropped(self) -> int:
        run = self.run
        return self._dropped + (run.dropped if run is not None else 0)

    @property
    def errors(self) -> int:
        """Failed opens, then the run's failed batches."""
        run = self.run
        return self._failed + (run.errors if run is not None else 0)

    @property
    def sent(self) -> int:
        run = self.run
        return run.sent if run is not None else 0

    def metrics(self, values: dict[str, float], step: int = 0) -> None:
        run = self.run
        if run is not None:
            run.metrics(values, step)
        else:
            self._dropped += sum(v is not None for v in values.values())

    def event(self, name: str, step: int = 0, **details) -> None:
        if self.run is None:
            with self._lock:
                if self.run is None:  # still: counted here, handed over at the open
                    self._events[name] = self._events.get(name, 0) + 1
                    self._tags[f"last_{name}"] = json.dumps(details, default=str)[:4000]
                    self._step = max(self._step, int(step))
                    return
        self.run.event(name, step, **details)

    def tag(self, key: str, value: str) -> None:
        if self.run is None:
            with self._lock:
                if self.run is None:
                    self._tags[key] = str(value)[:4000]
                    return
        self.run.tag(key, value)

    def flush(self) -> None:
        run = self.run
        if run is not None:
            run.flush()

    def close(self) -> None:
        with self._lock:
            self._stop.set()
            run = self.run
        if run is not None:
            run.close()

    # ---- the retries ----------------------------------------------------------------------------
    def _retry(self) -> None:
        delay = self._backoff.next()
        while not self._stop.wait(delay):
            self.attempts += 1
            try:
                run = self._opener()
            except Exception as e:  # noqa: BLE001 - MLflow still away: try again later
                self._failed += 1
                delay = self._backoff.next()
                log.warning("ops run %s: MLflow still unreachable (%d tries), next in %.1f s: %s",
                            self.name, self.attempts, delay, e)
                continue
            with self._lock:
                closed = self._stop.is_set()
                if not closed:
                    self._hand_over(run)
            if closed:  # closed while this open was under way
                run.close()
            else:
                log.warning("ops run %s: opened (%s) after %d tries", self.name, run.run_id,
                            self.attempts)
            return

    def _hand_over(self, run: OpsRun) -> None:
        """Under ``_lock``: what was kept goes to ``run``, which from now on takes every call."""
        for key, value in self._tags.items():
            run.tag(key, value)
        with run._lock:
            run._events.update(self._events)
        if self._events:
            run.metrics({f"event.{n}": c for n, c in self._events.items()}, self._step)
        self.run = run


def _open(tracking_uri: str, fingerprint, role: str, tenant: str, replica: str, **kw) -> OpsRun:
    return OpsRun(
        tracking_uri,
        f"specloop/{fingerprint.key()}",
        f"{role}-{tenant}-{replica}",
        tags={"role": role, "tenant": tenant, "replica": replica,
              "target_model_id": fingerprint.model_id},
        **kw,
    )


def open_run(tracking_uri: str | None, fingerprint, role: str, tenant: str, replica: str,
             **kw) -> OpsRun | None:
    """The ops run of one process, or None (no tracking URI, or MLflow unreachable: never fatal)."""
    if not tracking_uri:
        return None
    try:
        return _open(tracking_uri, fingerprint, role, tenant, replica, **kw)
    except Exception:
        log.warning("no MLflow ops run for %s (%s)", role, tracking_uri, exc_info=True)
        return None


def open_run_or_later(tracking_uri: str | None, fingerprint, role: str, tenant: str, replica: str,
                      *, retry_initial_s: float = 5.0, retry_max_s: float = 300.0,
                      **kw) -> OpsRun | PendingRun | None:
    """``open_run``, but MLflow unreachable now gives a PendingRun that opens the run once MLflow
    answers (retried after ``retry_initial_s``, doubling to ``retry_max_s``). None: no tracking URI."""
    run = open_run(tracking_uri, fingerprint, role, tenant, replica, **kw)
    if run is not None or not tracking_uri:
        return run
    log.warning("ops run %s-%s-%s: retrying in the background", role, tenant, replica)
    return PendingRun(lambda: _open(tracking_uri, fingerprint, role, tenant, replica, **kw),
                      f"{role}-{tenant}-{replica}", retry_initial_s=retry_initial_s,
                      retry_max_s=retry_max_s)
