"""Ray actor around TrainerLoop, and the wiring from TrainerSettings (``specloop train``).

The loop itself is plain Python (trainer/loop.py); the actor only owns it inside a Ray worker so
training runs beside serving on a cluster or, by default, on a local ``ray.init(num_cpus=2)``.
"""

from __future__ import annotations

import os

from trainer.config import TrainerSettings


def build_loop(settings: TrainerSettings, student, fingerprint, source=None, **kw):
    """TrainerLoop from settings; ``source`` defaults to the Kafka source of feedback/."""
    from trainer.distill import DistillConfig
    from trainer.gate import GateConfig
    from trainer.loop import LoopConfig, TrainerLoop
    from trainer.replay import ReplayBuffer

    s = settings
    if source is None:
        from feedback.kafka_source import KafkaTraceSource  # written by the feedback-bus issue

        source = KafkaTraceSource(bootstrap_servers=s.bootstrap_servers, topic=s.topic, group_id=s.group_id)
    registry = kw.pop("registry", None)
    if registry is None and s.tracking_uri:
        from feedback.registry import DrafterRegistry

        registry = DrafterRegistry(s.tracking_uri)
    if s.redis_url and ("saturated" not in kw or "announcer" not in kw):
        from feedback.control import ControlPlane
        from trainer.control import RedisAnnouncer, ServingLoad

        control = ControlPlane(url=s.redis_url)
        kw.setdefault("saturated", ServingLoad(control, s.max_queue_depth, s.max_utilisation))
        kw.setdefault("announcer", RedisAnnouncer(control, getattr(student, "kind", None), fingerprint.key()))
    return TrainerLoop(
        source, student, fingerprint,
        loop=LoopConfig(tenant=s.tenant, poll_records=s.poll_records, poll_timeout_s=s.poll_timeout_s,
                        min_train_traces=s.min_train_traces, steps_per_round=s.steps_per_round,
                        rounds_per_gate=s.rounds_per_gate, checkpoint_dir=s.checkpoint_dir,
                        lineage={"topic": s.topic, "group_id": s.group_id, "source": s.source}),
        distill=DistillConfig(loss=s.loss, discard_weight=s.discard_weight, reject_weight=s.reject_weight,
                              ce_weight=s.ce_weight, lr=s.lr, weight_decay=s.weight_decay,
                              batch_traces=s.batch_traces, max_len=s.max_len),
        gate=GateConfig(k=s.k, acceptance_margin=s.acceptance_margin, speedup_margin=s.speedup_margin,
                        draft_cost=s.draft_cost, hybrid=s.hybrid),
        replay=ReplayBuffer(capacity=s.replay_capacity, heldout_fraction=s.heldout_fraction,
                            heldout_size=s.heldout_size, half_life=s.half_life, fingerprint=fingerprint,
                            tenant=s.tenant),
        registry=registry, **kw)


class TrainerActor:
    """Ray actor body: ``ray.remote(TrainerActor).remote(settings, student_factory, fingerprint)``.

    ``student_factory()`` builds the student inside the worker.
    """

    def __init__(self, settings: TrainerSettings, student_factory, fingerprint, source_factory=None, **kw):
        import torch

        torch.set_num_threads(1)
        source = source_factory() if source_factory is not None else None
        self.loop = build_loop(settings, student_factory(), fingerprint, source, **kw)
        self._stop = False

    def run(self, max_rounds: int | None = None) -> dict:
        self.loop.run(max_rounds, stop=lambda: self._stop)
        return self.stats()

    def stop(self) -> None:
        self._stop = True

    def stats(self) -> dict:
        s = self.loop.stats
        return {"rounds": s.rounds, "paused_rounds": s.paused_rounds, "train_steps": s.train_steps,
                "records_polled": s.records_polled, "promotions": s.promotions,
                "last_decision": s.last_decision, "champion_version": self.loop.champion_version,
                "trace_tokens_seen": self.loop.replay.tokens_seen}


def init_ray(address: str | None = None, num_cpus: int = 2):
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if not ray.is_initialized():
        if address:
            ray.init(address=address)
        else:
            ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    return ray


def start_actor(settings: TrainerSettings, student_factory, fingerprint, source_factory=None, **kw):
    """Start the actor (local Ray unless ``settings.ray_address``); returns its handle."""
    ray = init_ray(settings.ray_address, settings.num_cpus)
    return ray.remote(num_cpus=1)(TrainerActor).remote(settings, student_factory, fingerprint, source_factory, **kw)
