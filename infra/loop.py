"""The closed loop, shared by ``specloop demo`` and ``specloop bench online``.

    TorchEngine (day-0 drafter) --traces--> Kafka --> TrainerLoop (Ray actor) --> MLflow registry
         ^                                                                          | Redis announce
         +------------------------------ Swapper (validate, swap, watch, roll back) <---+

Both halves are built from one settings tree (``loop_settings``: the environment's, pointed at the
local stack, with a topic, Redis namespace and tenant of the loop's own) through the composition
root (infra/root.py): serving runs in this process, built as ``specloop serve`` builds it; the
trainer runs in a local Ray actor (trainer/actor.py), a process of its own at lower priority, so
its Python never holds serving's GIL, and builds the loop ``specloop train`` runs inside the worker.

Requests are served one after another (latency-bound decoding, where speculation pays), each one a
``Point`` (tokens, wall time, tokens per verify step, live drafter version). The day-0 drafter and
the trainer's first student come from infra/day0.py; the costs the gate charges are measured by
infra/costs.py.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field

import torch
from prometheus_client import CollectorRegistry

from feedback.drafters.defaults import SELFSPEC_ADAPTER_LAYERS, SELFSPEC_EXIT_LAYER
from infra.costs import measure_costs
from infra.day0 import (
    FrozenDrafter,
    day0_drafter,
    learned_kind,
    make_selfspec_student,
    make_student,
)
from infra.measure import collect
from serving.engine.base import GenerationRequest, SamplingParams

log = logging.getLogger(__name__)


@dataclass
class LoopConfig:
    drafter: str = "hybrid"
    """suffix (model-free, learns on its own) | standalone (learned only) | hybrid (suffix + learned)."""
    k: int = 4
    max_tokens: int = 64
    train: bool = True
    """Run the trainer and the Swapper (False: the day-0 drafter throughout)."""
    adaptive_k: bool = False
    max_batch_size: int = 1
    min_train_traces: int = 8
    steps_per_round: int = 10
    rounds_per_gate: int = 2
    swap_watch_steps: int = 32
    rollback_floor_ratio: float = 0.8
    draft_vocab_size: int | None = 8192
    """The learned drafter reads its lm_head only for the lowest ids (BPE merges, most frequent
    first): drafting and training cost ~Vd/V of the vocabulary projection. None: full vocabulary."""
    batch_traces: int = 4
    """Traces per training step."""
    day0_init: str = "target-layers"
    """Day-0 learned drafter and student: "target-layers" (a standalone LM copying the target's first
    layers), "random", or "selfspec" (the target's own first layers + a trained adapter + its
    lm_head; feedback/drafters/from_target.py)."""
    day0_artifact: str | None = None
    """A selfspec artifact to start from (e.g. pre-trained on package text with ``specloop train
    --corpus``): serving's day-0 learned drafter (the hybrid's learned half from the first request)
    and the trainer's first student and champion. None: ``day0_init``."""
    selfspec_exit_layer: int = SELFSPEC_EXIT_LAYER
    """selfspec: target layers shared before the adapter."""
    selfspec_adapter_layers: int = SELFSPEC_ADAPTER_LAYERS
    """selfspec: trainable adapter layers (copies of the target's layers after the shared ones)."""
    ops_log: bool = True
    """Serving and trainer log what they do to MLflow ops runs from the first request."""
    ops_every_s: float = 2.0
    """Serving's ops metrics: one point per this many seconds."""
    trainer_nice: int = 10
    """The trainer process runs this much nicer than serving: it trains on capacity serving leaves."""
    gate_costs: dict | None = None
    """``{"draft_cost": .., "verify_cost": ..}`` (x one target step) the gate's simulation charges;
    None: measured here at start (``infra.costs.measure_costs``). Tests with tiny models, whose
    timings mean nothing, pass their own."""


@dataclass
class Point:
    index: int
    domain: str
    tokens: int
    wall_s: float
    accept_len: float
    version: str
    failed: bool = False
    output: list[int] = field(default_factory=list)
    done_at: float = 0.0

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0


def loop_settings(cfg: LoopConfig, stack, tag: str):
    """The settings tree of one loop: the environment's, pointed at ``stack`` (None: no services)
    under a topic, Redis namespace and tenant of the loop's own, with ``cfg``'s serving and
    training choices."""
    from infra.root import load_settings

    served = cfg.drafter if cfg.drafter in ("hybrid", "suffix") else learned_kind(cfg)
    serving = {"drafter": served, "k": cfg.k, "adaptive_k": cfg.adaptive_k, "max_batch_size": cfg.max_batch_size,
               "trace_sink": "none", "follow_traces": False, "swap_watch_steps": cfg.swap_watch_steps,
               "rollback_floor_ratio": cfg.rollback_floor_ratio, "swap_poll_interval_s": 10.0,
               "ops_log": cfg.ops_log, "ops_every_s": cfg.ops_every_s}
    trainer = {"serve_drafter": served, "group_id": f"trainer-{tag}", "k": cfg.k,
               "min_train_traces": cfg.min_train_traces, "steps_per_round": cfg.steps_per_round,
               "rounds_per_gate": cfg.rounds_per_gate, "batch_traces": cfg.batch_traces, "lr": 3e-3,
               "poll_records": 32, "poll_timeout_s": 0.5, "checkpoint_dir": None, "record_poll_times": True,
               "ops_log": cfg.ops_log}
    tree = load_settings(serving=serving, trainer=trainer)
    if stack is None:
        return tree.with_changes(serving={"ops_log": False}, trainer={"ops_log": False})
    return tree.on_stack(stack, kafka_topic=f"specloop.traces.{tag}", redis_namespace=f"specloop-{tag}",
                         tenant=f"demo-{tag}")


class OnlineLoop:
    """Engine + trace sink + Swapper + trainer actor against a running stack (infra.stack.StackInfo)."""

    def __init__(self, target, stack, cfg: LoopConfig, run_dir=None, tag: str | None = None,
                 drafter=None):
        """``stack``: None with ``cfg.train=False``. ``drafter``: serve with this one instead of
        the day-0 drafter of ``cfg.drafter`` (e.g. ``frozen_drafter()``)."""
        self.target, self.stack, self.cfg, self.run_dir = target, stack, cfg, run_dir
        self.tag = tag or uuid.uuid4().hex[:8]
        self.settings = loop_settings(cfg, stack, self.tag)
        """The settings tree this loop's serving and trainer are built from (infra/root.py)."""
        self.tenant = self.settings.endpoints.tenant
        self.metrics = CollectorRegistry()
        self.engine = self.sink = self.swapper = self.trainer = None
        self.ops = self.ops_observer = None
        """The serving replica's MLflow ops run and its observer (live acceptance per domain...)."""
        self.costs: dict = {}
        """Measured draft and verify costs the gate charges (``measure_costs``)."""
        self.points: list[Point] = []
        self.events: list[dict] = []
        """Swaps, rollbacks (the Swapper's) and acceptance drifts (serving's), in order."""
        self._swapper_events_seen = 0
        self._drifts: list[dict] = []
        """Swaps and rollbacks with the request index they happened at."""
        self.served: list[tuple[list[int], list[int]]] = []
        """(prompt, output) of every finished request, to rebuild a frozen suffix index."""
        self.snapshot_at: int | None = None
        self._frozen_parts = None
        self._request_ids: list[str] = []
        self._drafter = drafter

    # ---- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        from infra.root import build_serving

        drafter = self._drafter
        if drafter is None and self.cfg.k > 0:
            drafter = day0_drafter(self.cfg.drafter, self.target, self.cfg.draft_vocab_size, self.cfg.day0_init,
                                   {"exit_layer": self.cfg.selfspec_exit_layer,
                                    "adapter_layers": self.cfg.selfspec_adapter_layers}, self.cfg.day0_artifact)
        sink = None
        if self.cfg.train:
            from feedback.bus.kafka_sink import KafkaTraceSink

            s = self.settings.serving
            self.sink = sink = KafkaTraceSink(bootstrap_servers=s.kafka_bootstrap_servers, topic=s.kafka_topic)
        parts = build_serving(self.settings, target=self.target, drafter=drafter, registry=self.metrics,
                              sink=sink, swapper=self.cfg.train, replica_id=self.tag, on_drift=self._on_drift,
                              ops_flush_s=1.0)
        self.engine, self.swapper, self.ops_observer = parts.engine, parts.swapper, parts.ops_observer
        self.ops = self.ops_observer.run if self.ops_observer is not None else None
        await self.engine.start()
        if self.swapper is not None:
            self.swapper.start()
            self.swapper.wait_subscribed(5.0)
        if self.cfg.train:
            self._start_trainer()

    async def stop(self) -> None:
        if self.trainer is not None:
            self.trainer.stop()  # keeps its last stats and poll times for the figures
        if self.swapper is not None:
            self.swapper.stop()
            self._collect_events()  # a swap after the last request is still one (counted in ``swaps``)
        if self.engine is not None:
            await self.engine.stop()
        if self.sink is not None:
            self.sink.close()
        if self.ops is not None:
            self.ops_observer.flush()
            self.ops.close()

    def _start_trainer(self) -> None:
        if self.cfg.drafter == "suffix":
            return  # nothing to train: the suffix index learns in the engine
        from feedback.drafters.standalone_lm import StandaloneConfig
        from infra.root import trainer_loop_factory
        from trainer.actor import RemoteTrainer
        from trainer.device import settle

        c = self.cfg
        champion = None
        if c.day0_artifact is not None:
            from feedback.registry.artifact import read_meta

            champion = read_meta(c.day0_artifact).version  # serving runs it: candidates must beat it
        if c.day0_init == "selfspec" or c.day0_artifact is not None:
            student = make_selfspec_student(self.target, c.draft_vocab_size, c.selfspec_exit_layer,
                                            c.selfspec_adapter_layers, c.day0_artifact)
        else:
            student = make_student(self.target, c.draft_vocab_size, c.day0_init)
        self.costs = dict(c.gate_costs) if c.gate_costs is not None else measure_costs(
            self.target, student, c.k, bf16_activations=self.settings.serving.bf16_activations)
        log.info("gate costs (x one target step): %s", self.costs)
        placed, gpus = settle(self.settings.trainer)  # where the student trains, decided here (not in Ray's worker)
        self.settings = self.settings.with_changes(trainer={
            "draft_cost": self.costs["draft_cost"], "verify_cost": self.costs["verify_cost"],
            "verify_costs": self.costs.get("verify_costs"), "device": placed.device})
        export_config = getattr(student, "config", None) or StandaloneConfig.for_target(self.target.model.config)
        # The student travels to the worker pickled (tens of MB with frozen target embeddings).
        factory = trainer_loop_factory(self.settings, student, self.target.fingerprint, export_config,
                                       initial_champion=champion)
        self.trainer = RemoteTrainer(factory, threads=torch.get_num_threads(), nice=c.trainer_nice,
                                     num_gpus=gpus).start()

    # ---- serving --------------------------------------------------------------------------

    async def serve(self, items: list[tuple[list[int], str]], on_point=None, train: bool = True) -> list[Point]:
        """Serve (prompt ids, domain) one after another; ``on_point(point)`` after each."""
        out = []
        for prompt, domain in items:
            point = await self._one(prompt, domain, train)
            self.points.append(point)
            self._collect_events()
            out.append(point)
            if on_point is not None:
                on_point(point)
        return out

    async def _one(self, prompt: list[int], domain: str, train: bool) -> Point:
        params = SamplingParams(max_tokens=self.cfg.max_tokens, temperature=0.0)
        req = GenerationRequest(f"r-{uuid.uuid4().hex[:12]}", list(prompt), params,
                                tenant=self.tenant, domain=domain, train=train)
        version = str(getattr(self.engine.drafter, "version", "none"))
        t0 = time.perf_counter()
        try:
            tokens, last = await collect(self.engine, req)
        except Exception:
            log.exception("request failed")
            return Point(len(self.points), domain, 0, 0.0, 0.0, version, failed=True)
        wall = time.perf_counter() - t0
        self.served.append((list(prompt), tokens))
        accept = last.stats.mean_accept_len if last is not None and last.stats.verify_steps else 1.0
        self._request_ids.append(req.request_id)
        return Point(len(self.points), domain, len(tokens), wall, accept, version, output=tokens,
                     done_at=time.time())

    def _on_drift(self, ev) -> None:
        """A drift seen by serving (engine step thread; serving's builder also announces it to the
        trainer): drawn in the demo."""
        self._drifts.append({"event": "drift", "domain": ev.domain, "before": round(ev.before, 4),
                             "now": round(ev.now, 4), "at": time.time()})

    def _collect_events(self) -> None:
        """The Swapper's events and serving's drifts, in arrival order, at the request they followed."""
        new = []
        if self.swapper is not None:
            new += self.swapper.events[self._swapper_events_seen:]
            self._swapper_events_seen += len(new)
        while self._drifts:
            new.append(self._drifts.pop(0))
        for e in sorted(new, key=lambda e: e.get("at", 0.0)):
            self.events.append({**e, "request_index": len(self.points) - 1})  # "at": when it happened

    # ---- figures --------------------------------------------------------------------------

    @property
    def swaps(self) -> int:
        return self.swapper.swaps if self.swapper else 0

    @property
    def rollbacks(self) -> int:
        return self.swapper.rollbacks if self.swapper else 0

    @property
    def drifts(self) -> list[dict]:
        return [e for e in self.events if e.get("event") == "drift"]

    def freshness_s(self) -> list[float]:
        """Per trace: seconds from its request finishing to the first swap after the trainer
        polled it (a drafter trained on it is live). Traces never followed by a swap are left out."""
        return [s for _, s in self.freshness()]

    def freshness(self) -> list[tuple[str, float]]:
        """(version swapped in, seconds) per trace followed by a swap: see ``freshness_s``."""
        if self.trainer is None:
            return []
        served = list(zip(self._request_ids, [p.done_at for p in self.points if not p.failed]))
        return freshness_per_trace(served, self.trainer.polled_at(), self.events)

    def snapshot(self) -> None:
        """Remember the drafter as it is now, to serve later with it frozen (``frozen_drafter``)."""
        self.snapshot_at = len(self.served)
        self._frozen_parts = getattr(self.engine.drafter, "learned", None)
        if self.cfg.drafter == "standalone":
            self._frozen_parts = self.engine.drafter

    def frozen_drafter(self):
        """The drafter of ``snapshot()``: its learned weights, and a suffix index holding only
        the outputs served before the snapshot; neither learns any more."""
        from serving.drafters.factory import build_drafter
        from serving.drafters.hybrid import HybridDrafter

        if self.cfg.drafter == "standalone":
            return FrozenDrafter(self._frozen_parts)
        suffix = build_drafter("suffix", self.target)
        for prompt, output in self.served[: self.snapshot_at]:
            suffix.observe(self.tenant, output, prompt_ids=prompt)
        if self.cfg.drafter == "hybrid" and self._frozen_parts is not None:
            return FrozenDrafter(HybridDrafter(suffix, self._frozen_parts))
        return FrozenDrafter(suffix)


def freshness_per_trace(served: list[tuple[str, float]], polled_at: dict[str, float],
                    events: list[dict]) -> list[tuple[str, float]]:
    """(version, seconds) for each served (request id, finished at) whose trace the trainer polled
    (``polled_at``) before some swap in ``events``: from the request finishing to the first swap
    after the poll (a drafter trained on it is live), and the version swapped in then."""
    swaps = sorted((e["at"], str(e.get("version"))) for e in events if e.get("event") == "swap")
    out = []
    for rid, done_at in served:
        polled = polled_at.get(rid)
        later = [(at, v) for at, v in swaps if polled is not None and at >= polled]
        if later:
            out.append((later[0][1], later[0][0] - done_at))
    return out
