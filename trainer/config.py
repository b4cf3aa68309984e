"""Trainer settings (env prefix ``SPECLOOP_TRAINER_``).

The shared endpoints (Kafka, Redis, MLflow), the target model, the tenant and the serving drafter
kind are read under the names every process uses (feedback/endpoints.py; what docker-compose.yml
gives both containers); ``SPECLOOP_TRAINER_<FIELD>`` still overrides them for the trainer alone.
Only these prefixed names are read from the environment (never a bare ``MODEL`` or ``DEV_MODE``);
``validate_by_name`` lets callers (infra's settings tree, tests) pass fields by name:
``TrainerSettings(model=..., dev_mode=True)``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from feedback import endpoints as ep
from feedback.drafters.defaults import (
    SELFSPEC_ADAPTER_LAYERS,
    SELFSPEC_DRAFT_VOCAB_SIZE,
    SELFSPEC_EXIT_LAYER,
)

_OWN = "SPECLOOP_TRAINER_"

Precision = Literal["auto", "fp32", "bf16"]
"""Training steps' forward precision (trainer/distill.py ``autocast_bf16``)."""

DeviceSetting = Literal["auto", "cpu", "cuda"]
"""Where the student trains (trainer/device.py ``resolve_device``)."""


class TrainerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECLOOP_TRAINER_", validate_by_name=True)

    model: str | None = Field(None, validation_alias=ep.shared("model", ep.MODEL, _OWN),
                              description="Target model (directory or the default's name); None = the default SmolLM2.")
    tenant: str = Field("default", validation_alias=ep.shared("tenant", ep.TENANT, _OWN), description="Tenant whose traces are trained on and whose drafter is versioned.")
    drafter: Literal["standalone", "eagle", "selfspec"] = Field("standalone", description="Which learned drafter to train.")
    day0_drafter_dir: str | None = Field(None, validation_alias=ep.shared("day0_drafter_dir", ep.DRAFTER_DIR, _OWN),
                                         description="standalone: the day-0 draft serving starts with (SPECLOOP_DRAFTER_DIR, "
                                         "shared with serving): the first student and the champion "
                                         "candidates must beat. None: the student starts from the target's layers.")
    exit_layer: int = Field(SELFSPEC_EXIT_LAYER, description="selfspec: target layers shared before the trainable adapter.")
    adapter_layers: int = Field(SELFSPEC_ADAPTER_LAYERS, description="selfspec: trainable adapter layers after the shared ones.")
    draft_vocab_size: int | None = Field(SELFSPEC_DRAFT_VOCAB_SIZE, description="selfspec: lm_head rows read (lowest ids + "
                                         "specials); None = all. Serving's day-0 selfspec drafter reads the default.")
    source: Literal["kafka", "inprocess"] = Field(
        "kafka", description="Where traces come from: kafka (the trace topic below) or inprocess (a source "
        "the caller hands the trainer: tests, code embedding it; `specloop train` has none). The trainer "
        "refuses to start when the caller disagrees, so the lineage that records it is true.")
    bootstrap_servers: str = Field(ep.DEFAULT_KAFKA_BOOTSTRAP_SERVERS, validation_alias=ep.shared("bootstrap_servers", ep.KAFKA_BOOTSTRAP_SERVERS, _OWN), description="Kafka bootstrap servers.")
    topic: str = Field(ep.DEFAULT_KAFKA_TOPIC, validation_alias=ep.shared("topic", ep.KAFKA_TOPIC, _OWN), description="Trace topic.")
    group_id: str = Field("specloop-trainer", validation_alias=ep.shared("group_id", ep.KAFKA_GROUP, _OWN), description="Kafka consumer group (offsets are committed per group).")
    redis_url: str | None = Field(None, validation_alias=ep.shared("redis_url", ep.REDIS_URL, _OWN), description="Control plane; None = no heartbeats (always train), no announcements.")
    redis_namespace: str = Field(ep.DEFAULT_REDIS_NAMESPACE, validation_alias=ep.shared("redis_namespace", ep.REDIS_NAMESPACE, _OWN), description="Control-plane key prefix (shared with serving).")
    tracking_uri: str = Field("sqlite:///specloop-mlflow.db", validation_alias=ep.shared("tracking_uri", ep.MLFLOW_TRACKING_URI, _OWN), description="MLflow tracking + registry URI.")
    checkpoint_dir: str | None = Field(
        "./specloop-trainer-ckpt", description="Model + optimizer + replay checkpoints, each in a "
        "subdirectory per tenant, drafter kind and target (a trainer resumes only from its own; "
        "another one sharing the directory neither loads nor deletes them); None = none (a restart "
        "starts over).")
    ray_address: str | None = Field(None, description="Ray cluster address; None starts a local Ray with num_cpus.")
    num_cpus: int = Field(2, description="CPUs for a local Ray.")
    device: DeviceSetting = Field(
        "auto", description="Where the student trains: cuda (the actor asks Ray for one GPU; an error "
        "at start where none is seen), cpu, or auto (cuda where this process sees a GPU, else cpu). "
        "Traces and the gate's bookkeeping stay on the CPU (trainer/device.py).")

    record_poll_times: bool = Field(False, description="Remember when each request's trace first reached "
                                    "the trainer (freshness figures of the demo and benchmarks; grows with traffic).")
    poll_records: int = Field(64, description="Max traces per poll.")
    poll_timeout_s: float = Field(1.0, description="Poll wait.")
    min_train_traces: int = Field(16, description="Training traces needed before the first step.")
    steps_per_round: int = Field(20, description="Training steps between polls.")
    rounds_per_gate: int = Field(5, description="Rounds between gate evaluations.")
    max_queue_depth: int = Field(8, description="Pause training while any serving replica reports more waiting requests.")
    max_utilisation: float = Field(0.85, description="Pause training while serving busy fraction exceeds this.")

    loss: Literal["fkl", "rkl", "jsd", "tvd"] = Field("fkl", description="Distillation divergence.")
    discard_weight: float = Field(0.5, description="Weight of discarded-branch rows (0 = ignore them).")
    reject_weight: float = Field(0.1, description="Weight of the rejected-token (unlikelihood) term.")
    ce_weight: float = Field(0.0, description="Weight of the optional next-token CE.")
    lr: float = Field(1e-3, description="AdamW learning rate.")
    weight_decay: float = Field(0.01, description="AdamW weight decay.")
    batch_traces: int = Field(8, description="Traces per training step.")
    max_len: int = Field(512, description="Left-truncate training sequences to this many tokens.")
    precision: Precision = Field(
        "auto", description="Training steps' forward: bf16 autocast, fp32, or auto (bf16 where the "
        "hardware multiplies bf16 natively: CUDA, AVX512-BF16, AMX; fp32 elsewhere).")

    heldout_fraction: float = Field(0.15, description="Fraction of requests held out for the gate.")
    heldout_size: int = Field(64, description="Most recent held-out traces the gate judges on.")
    replay_capacity: int = Field(5000, description="Training traces kept.")
    half_life: float = Field(500.0, description="Recency half-life in traces.")
    traffic_window: int = Field(
        16, ge=0, description="A domain that is a quarter or more of the latest this many arrivals, "
        "and at most half that share of what training samples, is a shift of the traffic to it: "
        "training focuses there as on a drift serving reports; 0 = serving's drifts only.")
    trace_max_age_s: float | None = Field(
        None, gt=0, description="Retention: traces older than this (since their request finished) "
        "are dropped from the replay and its checkpoints; None = kept until displaced.")

    k: int = Field(4, description="Serving draft length the gate simulates.")
    acceptance_margin: float = Field(0.005, description="Absolute expected-acceptance margin to promote.")
    speedup_margin: float = Field(0.0, description="Relative simulated-speedup margin to promote.")
    refresh_after_s: float | None = Field(
        20.0, gt=0, description="Promote a candidate no worse than the champion (on both gate measures) "
        "once the champion has been live this long: small updates promoted often (trace -> live "
        "freshness); None = only a candidate that beats the champion by the margins.")
    refresh_speedup_slack: float = Field(
        0.01, ge=0, lt=1, description="A refresh may also simulate up to this fraction slower than the "
        "champion where its expected acceptance beats the champion's by acceptance_margin (a deficit "
        "within what the hybrid simulation can tell; serving's rollback watch judges every swap); "
        "0 = no slack.")
    draft_cost: float = Field(0.16, description="Learned draft token cost relative to a target step.")
    verify_cost: float | None = Field(None, description="Verify cost of k+1 tokens relative to a target step "
                                      "(as measured where serving runs); None = the gate's default.")
    verify_costs: list[float] | None = Field(None, description="Measured verify cost of 1..k drafts "
                                             "(a forward of 2..k+1 tokens) relative to a target step; None = "
                                             "linear up to verify_cost.")
    hybrid: bool = Field(True, description="Gate inside the hybrid policy with the suffix drafter.")
    serve_drafter: Literal["suffix", "eagle", "standalone", "selfspec", "hybrid"] | None = Field(
        None, validation_alias=AliasChoices(ep.DRAFTER),
        description="The drafter kind serving runs (the one setting both sides read: "
        "SPECLOOP_DRAFTER). When set it decides what is trained and how it is gated: "
        "suffix/hybrid -> the learned drafter gated inside the hybrid with the suffix index (what "
        "serving installs); eagle/standalone/selfspec -> that learned kind, gated alone.")

    ops_log: bool = Field(True, description="Log each round, gate decision, drift, pause and promotion to "
                          "the trainer's MLflow ops run (feedback/ops/ops_log.py).")

    dev_mode: bool = Field(
        False, validation_alias=ep.shared("dev_mode", ep.DEV_MODE, _OWN),
        description="Local dev mode: allows the published default secrets (e.g. the `mlflow` "
        "database password in tracking_uri) that are refused otherwise.")

    def distill_config(self):
        """The distiller's settings (trainer/distill.py ``DistillConfig``) from these."""
        from trainer.distill import DistillConfig

        return DistillConfig(loss=self.loss, discard_weight=self.discard_weight, reject_weight=self.reject_weight,
                             ce_weight=self.ce_weight, lr=self.lr, weight_decay=self.weight_decay,
                             batch_traces=self.batch_traces, max_len=self.max_len, precision=self.precision)

    @model_validator(mode="after")
    def _no_default_secrets(self) -> TrainerSettings:
        from feedback.secrets import check_uri_password

        check_uri_password("SPECLOOP_TRAINER_TRACKING_URI", self.tracking_uri, self.dev_mode)
        return self

    @model_validator(mode="after")
    def _follow_serving(self) -> TrainerSettings:
        """Train what serving serves (a replica refuses an artifact of another kind). A trainer
        setting of its own that contradicts it is an error, not silently replaced."""
        if self.serve_drafter in ("eagle", "standalone", "selfspec"):
            follows = {"drafter": self.serve_drafter, "hybrid": False}
        elif self.serve_drafter in ("suffix", "hybrid"):
            follows = {"hybrid": True}
        else:
            return self
        for name, value in follows.items():
            if name in self.model_fields_set and getattr(self, name) != value:
                raise ValueError(
                    f"the trainer's {name}={getattr(self, name)!r} (SPECLOOP_TRAINER_{name.upper()}) "
                    f"contradicts what serving serves (SPECLOOP_DRAFTER={self.serve_drafter}), which "
                    f"would refuse every promotion: leave the trainer's {name} unset, or serve that kind")
            setattr(self, name, value)
        return self
