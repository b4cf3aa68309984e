"""Distillation loop: replay samples -> examples -> KD + discard (+ CE) loss -> AdamW step.

Early stopping and model selection use held-out expected acceptance, never the loss: with a few
thousand traffic tokens the student memorises, held-out KL bottoms out and rises while train loss
keeps falling, and loss and acceptance disagree. ``fit`` keeps the best-on-held-out weights.

A step's forward runs under bf16 autocast where the hardware multiplies bf16 natively (a CUDA GPU;
a CPU with AVX512-BF16 or AMX): the weights and the optimizer stay fp32 and the losses are computed
in fp32 (kernels/losses.py), so only the matmuls' inputs are rounded. Held-out evaluation stays
fp32. How many steps a round affords is what a drafter learns from little traffic with (more steps
on the same requests raise held-out acceptance), so this is worth ~1.5x on such a CPU.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Literal, get_args

import numpy as np
import torch

from feedback.bus.trace import TraceRecord
from trainer.config import Precision
from trainer.examples import build_examples
from trainer.gate import GateConfig, score
from trainer.replay import ReplayBuffer
from trainer.students import RowBatch

LossKind = Literal["fkl", "rkl", "jsd", "tvd"]
PRECISIONS: tuple[str, ...] = get_args(Precision)


def autocast_bf16(precision: Precision, device: torch.device) -> bool:
    """Whether training steps on ``device`` run under bf16 autocast (``auto``: where bf16 matmuls
    are native and faster than fp32)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    if precision != "auto":
        return precision == "bf16"
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    from kernels.cpu import native_bf16

    return device.type == "cpu" and native_bf16()


@dataclass
class DistillConfig:
    loss: LossKind = "fkl"
    discard_weight: float = 0.5
    """Weight of discarded-branch rows in the distillation loss (0 drops the branches)."""
    reject_weight: float = 0.1
    """Weight of the discard term pushing probability off the rejected drafted token."""
    ce_weight: float = 0.0
    """Optional next-token cross-entropy on the target's top-1 token."""
    lr: float = 1e-3
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    batch_traces: int = 8
    max_len: int = 512
    eval_every: int = 20
    patience: int = 4
    """Evaluations without held-out improvement before stopping."""
    seed: int = 0
    precision: Precision = "auto"
    """Training steps' forward: bf16 autocast (``bf16``), fp32, or ``auto`` (bf16 where native)."""


def compute_loss(rows: RowBatch, cfg: DistillConfig) -> tuple[torch.Tensor, dict[str, float]]:
    from kernels.losses import discard_loss, distill_loss, next_token_ce

    kd = distill_loss(rows.logits, rows.topk_ids, rows.topk_logprobs, kind=cfg.loss, weights=rows.weights)
    total = kd
    parts = {"loss_kd": float(kd.detach())}
    has_rej = rows.rejected_ids >= 0  # [N]
    if cfg.reject_weight > 0 and bool(has_rej.any()):
        rej = discard_loss(rows.logits[has_rej], rows.rejected_ids[has_rej], weights=rows.weights[has_rej])
        total = total + cfg.reject_weight * rej
        parts["loss_reject"] = float(rej.detach())
    if cfg.ce_weight > 0:
        top1 = rows.topk_ids[:, 0]  # [N] target's most likely token (draft vocab; -1 outside)
        ok = top1 >= 0
        if bool(ok.any()):
            ce = next_token_ce(rows.logits[ok], top1[ok], weights=rows.weights[ok])
            total = total + cfg.ce_weight * ce
            parts["loss_ce"] = float(ce.detach())
    parts["loss"] = float(total.detach())
    return total, parts


@dataclass
class FitResult:
    steps: int
    best_step: int
    best_acceptance: float
    stopped_early: bool
    losses: list[float] = field(default_factory=list)
    curve: list[dict] = field(default_factory=list)
    """Held-out evaluations: {step, expected_acceptance, sim_accept_len, loss}."""
    seconds: float = 0.0
    train_seconds: float = 0.0
    """Time in training steps only (no held-out evaluation)."""
    yielded: bool = False
    """Stopped because ``should_stop()`` said so (serving saturated) before ``max_steps``."""


class Distiller:
    """Owns a student's optimizer; ``step`` trains on a list of traces, ``fit`` runs to early stop."""

    def __init__(self, student, cfg: DistillConfig | None = None):
        self.student = student
        self.cfg = cfg or DistillConfig()
        self.optimizer = torch.optim.AdamW(
            [p for p in student.model.parameters() if p.requires_grad], lr=self.cfg.lr, weight_decay=self.cfg.weight_decay
        )
        self.global_step = 0
        self.rng = np.random.default_rng(self.cfg.seed)
        device = next(student.model.parameters()).device
        self.bf16 = autocast_bf16(self.cfg.precision, device)
        self._autocast = lambda: torch.autocast(device.type, dtype=torch.bfloat16, enabled=self.bf16)

    @property
    def train_precision(self) -> str:
        """What the steps run in here: "bf16" (autocast) or "fp32" (``cfg.precision`` resolved)."""
        return "bf16" if self.bf16 else "fp32"

    def step(self, records: list[TraceRecord]) -> dict[str, float]:
        cfg = self.cfg
        examples = [
            ex
            for r in records
            for ex in build_examples(
                r, discard_weight=cfg.discard_weight, include_discard=cfg.discard_weight > 0, max_len=cfg.max_len
            )
        ]
        self.student.model.train()
        with self._autocast():
            rows = self.student.row_batch(examples)  # logits [N, Vd] in bf16 under autocast
            loss, parts = compute_loss(rows, cfg)  # fp32 whatever the logits' dtype
        self.optimizer.zero_grad(set_to_none=True)
        if not torch.isfinite(loss):
            return parts  # never step on a non-finite loss; the gate sees it in the loss history
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.student.model.parameters(), cfg.grad_clip)
        self.optimizer.step()
        self.global_step += 1
        return parts

    def evaluate(self, heldout: list[TraceRecord], k: int = 4) -> dict[str, float]:
        self.student.model.eval()
        s = score(self.student, heldout, GateConfig(k=k, hybrid=False), None)
        return {"expected_acceptance": s.expected_acceptance, "sim_accept_len": s.sim_accept_len}

    def fit(self, replay: ReplayBuffer, max_steps: int, k: int = 4, should_stop=None) -> FitResult:
        """Train up to ``max_steps``, evaluating every ``eval_every``; restore the best weights.

        ``should_stop()`` (optional) is polled between steps (serving saturated, shutdown).
        """
        cfg = self.cfg
        t0 = time.perf_counter()
        heldout = replay.heldout
        best = self.evaluate(heldout, k)["expected_acceptance"] if heldout else -math.inf
        best_state = self._trainable_state()
        res = FitResult(steps=0, best_step=self.global_step, best_acceptance=best, stopped_early=False)
        res.curve.append({"step": self.global_step, "tokens_seen": replay.tokens_seen,
                          "expected_acceptance": best, "loss": float("nan")})
        bad = 0
        for i in range(max_steps):
            if should_stop is not None and should_stop():
                res.yielded = True
                break
            ts = time.perf_counter()
            parts = self.step(replay.sample(cfg.batch_traces, self.rng))
            res.train_seconds += time.perf_counter() - ts
            res.losses.append(parts["loss"])
            res.steps += 1
            if not math.isfinite(parts["loss"]):
                break
            if heldout and ((i + 1) % cfg.eval_every == 0 or i + 1 == max_steps):
                ev = self.evaluate(heldout, k)
                res.curve.append({"step": self.global_step, "tokens_seen": replay.tokens_seen,
                                  "loss": parts["loss"], **ev})
                if ev["expected_acceptance"] > best:
                    best, bad = ev["expected_acceptance"], 0
                    best_state = self._trainable_state()
                    res.best_step = self.global_step
                else:
                    bad += 1
                    if bad >= cfg.patience:
                        res.stopped_early = True
                        break
        if heldout:
            self.student.load_trainable(best_state)
        res.best_acceptance = best
        res.seconds = time.perf_counter() - t0
        return res

    def _trainable_state(self) -> dict[str, torch.Tensor]:
        """Copies of the parameters training changes (a drafter sharing the target's frozen layers
        would otherwise copy them at every held-out improvement)."""
        return {n: t.clone() for n, t in self.student.trainable_state().items()}

    def state_dict(self) -> dict:
        return {
            "model": self.student.trainable_state(),  # the frozen target layers are not saved
            "optimizer": self.optimizer.state_dict(),
            "global_step": self.global_step,
            "rng": self.rng.bit_generator.state,
        }

    def load_state_dict(self, state: dict) -> None:
        self.student.load_trainable(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.global_step = int(state["global_step"])
        self.rng.bit_generator.state = state["rng"]
