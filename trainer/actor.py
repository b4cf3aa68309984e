"""Ray actor around TrainerLoop, and the wiring from TrainerSettings (``specloop train``).

The loop itself is plain Python (trainer/loop.py); the actor only owns it inside a Ray worker so
training runs beside serving on a cluster or, by default, on a local ``ray.init(num_cpus=2)``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import time

from feedback.background.priority import lower_thread_priority
from trainer.config import TrainerSettings
from trainer.loop import LoopStats

log = logging.getLogger(__name__)


def check_source(settings: TrainerSettings, given: bool) -> None:
    """Refuse a trace source that contradicts ``settings.source`` (``given``: the caller hands one in)."""
    if settings.source == "inprocess" and not given:
        raise ValueError("SPECLOOP_TRAINER_SOURCE=inprocess needs a trace source handed in by the caller "
                         "(tests, embedding code); `specloop train` reads Kafka: use source=kafka")
    if settings.source == "kafka" and given:
        raise ValueError("a trace source was handed in, but SPECLOOP_TRAINER_SOURCE=kafka: use source=inprocess")


def build_loop(settings: TrainerSettings, student, fingerprint, source=None, **kw):
    """TrainerLoop from settings; ``source`` defaults to the Kafka source of feedback/ (the caller's
    must agree with ``settings.source``: ``check_source``). What ``specloop train``, the demo and
    ``bench online`` all run (inside the trainer's Ray worker)."""
    check_source(settings, source is not None)
    from trainer.device import resolve_device
    from trainer.gate import GateConfig
    from trainer.loop import LoopConfig, TrainerLoop
    from trainer.replay import ReplayBuffer

    s = settings
    student.to(resolve_device(s.device))  # before the distiller builds its optimizer on the weights
    if source is None:
        from feedback.bus.kafka_source import KafkaTraceSource  # written by the feedback-bus issue

        source = KafkaTraceSource(bootstrap_servers=s.bootstrap_servers, topic=s.topic, group_id=s.group_id)
        if s.record_poll_times:
            from trainer.sources import TimedSource

            source = TimedSource(source)
    registry = kw.pop("registry", None)
    if registry is None and s.tracking_uri:
        from feedback.registry.drafter_registry import DrafterRegistry

        registry = DrafterRegistry(s.tracking_uri)
    if s.redis_url and ("saturated" not in kw or "announcer" not in kw):
        from feedback.control.plane import ControlPlane
        from trainer.control import RedisAnnouncer, ServingLoad

        control = ControlPlane(url=s.redis_url, namespace=s.redis_namespace)
        kw.setdefault("saturated", ServingLoad(control, s.max_queue_depth, s.max_utilisation))
        kw.setdefault("announcer", RedisAnnouncer(control, getattr(student, "kind", None), fingerprint.key()))
        kw.setdefault("deletions", control)  # tenant data deletion requests (the admin route)
        kw.setdefault("rollbacks_from", control)  # serving's rollbacks: the champion follows them
    if "ops" not in kw and s.ops_log and s.tracking_uri:
        from feedback.ops.ops_log import open_run_or_later  # MLflow away now: opened once back

        kw["ops"] = open_run_or_later(s.tracking_uri, fingerprint, "trainer", s.tenant, s.group_id)
    return TrainerLoop(
        source, student, fingerprint,
        loop=LoopConfig(tenant=s.tenant, poll_records=s.poll_records, poll_timeout_s=s.poll_timeout_s,
                        min_train_traces=s.min_train_traces, steps_per_round=s.steps_per_round,
                        rounds_per_gate=s.rounds_per_gate, checkpoint_dir=s.checkpoint_dir,
                        traffic_window=s.traffic_window or None,
                        lineage={"topic": s.topic, "group_id": s.group_id, "source": s.source}),
        distill=s.distill_config(),
        gate=GateConfig(k=s.k, acceptance_margin=s.acceptance_margin, speedup_margin=s.speedup_margin,
                        draft_cost=s.draft_cost, hybrid=s.hybrid, refresh_after_s=s.refresh_after_s,
                        refresh_speedup_slack=s.refresh_speedup_slack,
                        **({"verify_cost": s.verify_cost} if s.verify_cost is not None else {}),
                        **({"verify_costs": tuple(s.verify_costs)} if s.verify_costs else {})),
        replay=ReplayBuffer(capacity=s.replay_capacity, heldout_fraction=s.heldout_fraction,
                            heldout_size=s.heldout_size, half_life=s.half_life, fingerprint=fingerprint,
                            tenant=s.tenant, max_age_s=s.trace_max_age_s),
        registry=registry, **kw)


class TrainerActor:
    """Ray actor body: owns a TrainerLoop that ``loop_factory()`` builds inside the worker (so
    models, Kafka consumers and Redis connections are created where they are used, not pickled).

    Spawned with ``max_concurrency=2`` (``spawn_actor``): ``stats()`` and ``stop()`` are answered
    while ``run()`` trains. ``nice`` lowers the priority of the worker's training thread, so the
    trainer takes only capacity serving leaves spare."""

    def __init__(self, loop_factory, threads: int = 1, nice: int = 0):
        import torch

        torch.set_num_threads(threads)
        self.nice = nice
        lower_thread_priority(nice, "trainer")
        self.loop = loop_factory()
        self._stop = threading.Event()

    def run(self, max_rounds: int | None = None) -> dict:
        lower_thread_priority(self.nice, "trainer")  # run() executes on one of the actor's own threads
        self.loop.run(max_rounds, stop=self._stop.is_set)
        return self.stats()

    def stop(self) -> None:
        self._stop.set()

    def stats(self) -> dict:
        s = self.loop.stats
        return {"rounds": s.rounds, "paused_rounds": s.paused_rounds, "train_steps": s.train_steps,
                "records_polled": s.records_polled, "promotions": s.promotions, "round_errors": s.round_errors,
                "drifts": s.drifts, "traffic_shifts": s.traffic_shifts,
                "last_decision": s.last_decision, "champion_version": self.loop.champion_version,
                "trace_tokens_seen": self.loop.replay.tokens_seen,
                "curve": s.curve[-1:]}  # the latest held-out evaluation (the whole curve is in MLflow)

    def polled_at(self) -> dict[str, float]:
        """Request id -> wall time its trace reached the trainer (a ``TimedSource``; else empty)."""
        return dict(getattr(self.loop.source, "polled_at", {}))


def spawn_actor(loop_factory, threads: int = 1, nice: int = 0, num_cpus: float = 1, max_restarts: int = 5,
                num_gpus: int = 0):
    """A TrainerActor on the current Ray (``init_ray`` first); returns its handle. ``num_gpus``: 1 for
    a CUDA student (trainer/device.py); Ray hides every GPU from an actor that asks for none.

    A worker that dies (OOM, a killed process) is restarted by Ray up to ``max_restarts`` times:
    ``loop_factory`` runs again, so the loop resumes from its latest checkpoint and the consumer
    group from its committed offsets; a ``run()`` in flight is retried on the new worker."""
    import ray

    return ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, max_concurrency=2, max_restarts=max_restarts,
                      max_task_retries=-1)(TrainerActor).remote(loop_factory, threads, nice)


class RemoteTrainer:
    """The driver's handle on a trainer running in a Ray actor: ``start()``, ``stats`` (the loop's
    counters, re-read at most every ``refresh_s``), ``polled_at()``, ``stop()``. ``num_gpus``: what
    the actor asks Ray for (``trainer.device.settle``)."""

    def __init__(self, loop_factory, threads: int = 1, nice: int = 0, refresh_s: float = 0.5, num_gpus: int = 0):
        self.loop_factory, self.threads, self.nice, self.refresh_s = loop_factory, threads, nice, refresh_s
        self.num_gpus = num_gpus
        self.actor = self._run = None
        self._stats, self._read_at = LoopStats(), -float("inf")
        self._polled: dict[str, float] = {}
        self._owns_ray = False

    def start(self) -> RemoteTrainer:
        import ray

        self._owns_ray = not ray.is_initialized()  # then stop() shuts down the Ray it started
        init_ray(num_gpus=self.num_gpus)
        self.actor = spawn_actor(self.loop_factory, self.threads, self.nice, num_gpus=self.num_gpus)
        self._run = self.actor.run.remote()
        return self

    @property
    def stats(self) -> LoopStats:
        now = time.monotonic()
        if self.actor is not None and now - self._read_at >= self.refresh_s:
            import ray

            try:
                self._stats = _loop_stats(ray.get(self.actor.stats.remote(), timeout=30))
            except (ray.exceptions.RayError, TimeoutError) as e:  # worker died: keep the last figures
                log.warning("trainer actor unreachable: %s", e)
            self._read_at = now
        return self._stats

    def polled_at(self) -> dict[str, float]:
        if self.actor is not None:
            import ray

            try:
                self._polled = ray.get(self.actor.polled_at.remote(), timeout=30)
            except (ray.exceptions.RayError, TimeoutError) as e:
                log.warning("trainer actor unreachable: %s", e)
        return self._polled

    def stop(self, timeout_s: float = 120.0) -> LoopStats:
        """Ask the loop to stop after its current round, wait for it, then end the actor."""
        if self.actor is None:
            return self._stats
        import ray

        self.polled_at()
        self.actor.stop.remote()
        try:
            self._stats = _loop_stats(ray.get(self._run, timeout=timeout_s))
        except (ray.exceptions.RayError, TimeoutError) as e:  # a crashed loop, or one stuck past the timeout
            log.warning("trainer did not stop cleanly: %s", e)
        ray.kill(self.actor)
        self.actor = self._run = None
        if self._owns_ray:
            ray.shutdown()
        return self._stats


def _loop_stats(d: dict) -> LoopStats:
    names = {f.name for f in dataclasses.fields(LoopStats)}
    return LoopStats(**{k: v for k, v in d.items() if k in names})


def init_ray(address: str | None = None, num_cpus: int = 2, num_gpus: int = 0):
    """Connect to ``address``'s Ray, or start a local one with ``num_cpus``; a local one that must
    place a GPU actor (``num_gpus``) is told the GPUs this process sees rather than left to detect them."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if not ray.is_initialized():
        if address:
            ray.init(address=address)
        else:
            import torch

            gpus = {"num_gpus": torch.cuda.device_count()} if num_gpus else {}
            ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, **gpus)
    return ray


def start_actor(settings: TrainerSettings, student_factory, fingerprint, source_factory=None, **kw):
    """Start the actor (local Ray unless ``settings.ray_address``); returns its handle. A source
    contradicting ``settings.source`` is refused here, before Ray starts (``check_source``)."""
    from trainer.device import settle

    check_source(settings, source_factory is not None)
    settings, gpus = settle(settings)  # a CUDA trainer without a GPU is refused here, before Ray starts
    init_ray(settings.ray_address, settings.num_cpus, gpus)
    factory = functools.partial(_loop_from_settings, settings, student_factory, fingerprint, source_factory, kw)
    return spawn_actor(factory, num_gpus=gpus)


def _loop_from_settings(settings, student_factory, fingerprint, source_factory, kw):
    source = source_factory() if source_factory is not None else None
    return build_loop(settings, student_factory(), fingerprint, source, **kw)
