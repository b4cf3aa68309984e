"""Where the student trains (trainer/device.py), and the device discipline a CUDA trainer needs.

No GPU here or in CI, so the discipline is checked on the CPU: a training step, a held-out
evaluation and a gate score run with PyTorch's default device set to ``meta``. Every tensor the
trainer creates without naming its device then lands on ``meta`` instead of the CPU, as it would
land on the CPU beside a CUDA student; a meta tensor has no values, so any such tensor that reaches
the student's arithmetic, a loss or a score fails the run (an error, or a result that cannot be
read back).
"""

import math

import pytest
import torch
from trainer_tracegen import VOCAB, make_trace, tiny_lm

from trainer.config import TrainerSettings
from trainer.device import ray_gpus, resolve_device, settle
from trainer.distill import DistillConfig, Distiller
from trainer.gate import GateConfig, score
from trainer.students import StandaloneStudent

NO_GPU = not torch.cuda.is_available()


def _standalone():
    return StandaloneStudent(tiny_lm(seed=0)), 0


def _standalone_draft_vocab():
    return StandaloneStudent(tiny_lm(seed=0), head_vocab=torch.arange(0, VOCAB, 2)), 0


def _selfspec():
    from transformers import LlamaConfig, LlamaForCausalLM

    from feedback.drafters.from_target import assemble, selfspec_adapter_from_target
    from trainer.students import SelfSpecStudent

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256)
    target = LlamaForCausalLM(cfg).eval()
    adapter = selfspec_adapter_from_target(target, exit_layer=1, draft_vocab=torch.arange(0, VOCAB, 2))
    return SelfSpecStudent(assemble(adapter.float(), target), adapter.config), 0


def _eagle():
    from feedback.drafters.eagle_head import eagle_from_target
    from serving.target import tiny_target
    from trainer.eagle_student import EagleStudent

    target = tiny_target(vocab_size=VOCAB, hidden_size=32, num_layers=3, seed=11)
    return EagleStudent(eagle_from_target(target.model, feature_layers=(0, 1, 2), seed=3), depth=2), 96


@pytest.mark.parametrize("build", [_standalone, _standalone_draft_vocab, _selfspec, _eagle],
                         ids=["standalone", "standalone-draft-vocab", "selfspec", "eagle"])
def test_every_tensor_a_step_and_a_score_make_is_on_the_students_device(build):
    student, hidden = build()
    records = [make_trace("a", seed=i, hidden=hidden) for i in range(4)]
    distiller = Distiller(student, DistillConfig(lr=3e-3, batch_traces=2, precision="fp32"))
    cfg = GateConfig(k=3, hybrid=False)
    before = score(student, records[2:], cfg, None)
    with torch.device("meta"):
        parts = distiller.step(records[:2])
        after = score(student, records[2:], cfg, None)
        evaluated = student.evaluate(records[3], k=3, branches=2)
    assert math.isfinite(parts["loss"]) and distiller.global_step == 1
    assert math.isfinite(after.expected_acceptance) and after.rows == before.rows > 0
    assert len(evaluated.accept_at) == len(records[3].output_ids)
    assert all(p.device.type == "cpu" for p in student.model.parameters())


def test_a_student_moves_with_the_id_tables_its_forwards_index():
    student, _ = _standalone_draft_vocab()
    record = make_trace("a", seed=5)
    want = student.evaluate(record, k=3)
    student.to("cpu")  # a move resets the gathered head rows and the id table; results unchanged
    got = student.evaluate(record, k=3)
    assert student.device.type == "cpu"
    assert (got.accept_at == want.accept_at).all() and got.overlap == pytest.approx(want.overlap)


def test_auto_trains_where_this_process_sees_a_gpu():
    assert resolve_device("auto").type == ("cpu" if NO_GPU else "cuda")
    assert resolve_device("cpu").type == "cpu"


@pytest.mark.skipif(not NO_GPU, reason="this machine has a CUDA GPU")
def test_cuda_without_a_gpu_is_refused_at_start_not_trained_on_the_cpu():
    with pytest.raises(ValueError, match="SPECLOOP_TRAINER_DEVICE=cuda"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="SPECLOOP_TRAINER_DEVICE=cuda"):
        settle(TrainerSettings(device="cuda", tracking_uri=""))


def test_the_device_is_decided_before_the_actor_and_a_cuda_one_asks_ray_for_a_gpu(monkeypatch):
    monkeypatch.setenv("SPECLOOP_TRAINER_DEVICE", "auto")
    settings = TrainerSettings(tracking_uri="")
    assert settings.device == "auto"
    placed, gpus = settle(settings)
    assert placed.device == ("cpu" if NO_GPU else "cuda") and gpus == (0 if NO_GPU else 1)
    assert ray_gpus(torch.device("cuda")) == 1 and ray_gpus(torch.device("cpu")) == 0
    monkeypatch.setenv("SPECLOOP_TRAINER_DEVICE", "gpu")
    with pytest.raises(ValueError, match="device"):
        TrainerSettings(tracking_uri="")


def test_start_actor_places_the_actor_where_the_device_was_decided(monkeypatch):
    """``specloop train``'s wiring: the device is decided in the driver, the actor's settings carry
    the decision (not ``auto``, which a GPU-less Ray worker would resolve to the CPU), and Ray is
    asked for the GPU it needs."""
    from trainer import actor

    seen = {}
    monkeypatch.setattr(actor, "init_ray", lambda address, cpus, gpus: seen.update(init_gpus=gpus))
    monkeypatch.setattr(actor, "spawn_actor", lambda factory, num_gpus: seen.update(factory=factory, gpus=num_gpus))
    settings = TrainerSettings(device="auto", source="inprocess", tracking_uri="")
    actor.start_actor(settings, lambda: None, None, source_factory=lambda: None)
    want = ("cpu", 0) if NO_GPU else ("cuda", 1)
    assert (seen["factory"].args[0].device, seen["gpus"]) == want and seen["init_gpus"] == want[1]
