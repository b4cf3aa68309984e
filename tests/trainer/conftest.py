import pytest
import torch
from trainer_tracegen import FP, make_trace, tiny_lm


@pytest.fixture(scope="module")
def domain_a_replay():
    from trainer.replay import ReplayBuffer

    rb = ReplayBuffer(heldout_fraction=0.2, fingerprint=FP)
    rb.extend(make_trace("a", seed=i) for i in range(80))
    return rb


@pytest.fixture(scope="module")
def trained_student(domain_a_replay):
    """A tiny standalone student distilled on domain a (and the fit result)."""
    from trainer.distill import DistillConfig, Distiller
    from trainer.students import StandaloneStudent

    torch.set_num_threads(1)
    st = StandaloneStudent(tiny_lm(seed=0))
    res = Distiller(st, DistillConfig(lr=3e-3, eval_every=20)).fit(domain_a_replay, 80, k=3)
    return st, res


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """A tiny target (the real tokenizer, random weights) and the directory it is saved in, as
    ``specloop train --model DIR`` reads it."""
    from serving.target import tiny_target

    target = tiny_target(num_layers=4, seed=0)
    d = tmp_path_factory.mktemp("tiny") / "tiny-target"
    target.model.save_pretrained(d)
    target.tokenizer.save_pretrained(d)
    return target, d


@pytest.fixture
def selfspec_env(monkeypatch):
    """``specloop train`` settings for a small selfspec student on the tiny target (no MLflow)."""
    monkeypatch.setenv("SPECLOOP_TRAINER_DRAFTER", "selfspec")
    monkeypatch.setenv("SPECLOOP_TRAINER_EXIT_LAYER", "1")
    monkeypatch.setenv("SPECLOOP_TRAINER_DRAFT_VOCAB_SIZE", "4096")
    monkeypatch.setenv("SPECLOOP_TRAINER_BATCH_TRACES", "2")
    monkeypatch.delenv("SPECLOOP_TRAINER_TRACKING_URI", raising=False)
