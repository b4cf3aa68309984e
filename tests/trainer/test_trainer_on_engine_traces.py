"""Headline: traces a TorchEngine produced on one domain train drafters that the gate promotes.

The tiny target is made learnable and peaked: its attention and MLP outputs are scaled down (the
next-token distribution depends mostly on the last token, a "bigram" of the target's own making)
and its untied lm_head is scaled up (low-entropy distributions). Prompts of the domain are drawn
from the lower half of the vocabulary; outputs are sampled at temperature 1 so they are not one
memorisable cycle. The students start from random weights, so the held-out rise is the trainer's.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.bench_train import generate_traces
from trainer.distill import DistillConfig
from trainer.gate import GateConfig
from trainer.loop import LoopConfig, TrainerLoop
from trainer.sources import ListTraceSource

VOCAB, LAYERS, FEATURE_LAYERS, K, HELDOUT = 64, 4, (1, 2, 3), 3, 0.2


def learnable_target():
    from serving.target import tiny_target

    t = tiny_target(vocab_size=VOCAB, hidden_size=32, num_layers=LAYERS, seed=11)
    gen = torch.Generator().manual_seed(12)
    with torch.no_grad():
        for layer in t.model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.05)
            layer.mlp.down_proj.weight.mul_(0.05)
        t.model.lm_head.weight = torch.nn.Parameter(torch.randn(VOCAB, 32, generator=gen) * 0.6)
    return t


def domain_prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB // 2, (int(torch.randint(3, 8, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.fixture(scope="module")
def engine_setup():
    torch.set_num_threads(1)
    target = learnable_target()
    traces = generate_traces(target, domain_prompts(96, seed=1), k=K, max_new_tokens=32, temperature=1.0,
                             feature_layers=FEATURE_LAYERS, domain="a", tenant="acme", id_prefix="a")
    return target, traces


def _loop(student, traces, tmp_path, fp, exporter):
    from feedback.registry.drafter_registry import DrafterRegistry
    from trainer.replay import ReplayBuffer

    reg = DrafterRegistry(f"sqlite:///{tmp_path}/mlflow.db")
    loop = TrainerLoop(
        ListTraceSource(traces), student, fp,
        loop=LoopConfig(tenant="acme", poll_records=32, min_train_traces=16, steps_per_round=40,
                        rounds_per_gate=1, checkpoint_dir=str(tmp_path / "ckpt")),
        distill=DistillConfig(lr=3e-3, eval_every=20, patience=3, batch_traces=8),
        gate=GateConfig(k=K, draft_cost=0.1, hybrid=False),  # see trainer_tracegen.NOT_SUFFIX_TEXT
        replay=ReplayBuffer(heldout_fraction=HELDOUT, heldout_size=32, fingerprint=fp, tenant="acme",
                            min_heldout=0),  # the pure hash split: the test names its held-out set
        registry=reg, exporter=exporter)
    return loop, reg


def test_engine_traces_carry_features_and_rejections(engine_setup):
    _target, traces = engine_setup
    assert len(traces) == 96
    t = traces[0]
    assert t.hidden_layers == FEATURE_LAYERS
    assert t.hidden_states.shape == (len(t.prompt_ids) + len(t.output_ids) - 1, 32 * len(FEATURE_LAYERS))
    assert sum(int((r.steps.num_accepted < r.steps.num_drafted).sum()) for r in traces) > 0  # discards exist


@pytest.mark.parametrize("kind", ["standalone", "eagle"])
def test_trainer_raises_heldout_acceptance_gate_promotes_and_version_reloads(engine_setup, tmp_path, kind):
    from feedback.drafters.eagle_head import eagle_from_target
    from feedback.drafters.standalone_lm import StandaloneConfig, standalone_from_target
    from feedback.drafters.vocab import day0_draft_vocab
    from trainer.eagle_student import EagleStudent, traffic_frequencies
    from trainer.export import artifact_exporter
    from trainer.gate import score
    from trainer.replay import is_heldout
    from trainer.students import StandaloneStudent

    target, traces = engine_setup
    fp = target.fingerprint
    if kind == "standalone":
        model = standalone_from_target(target.model, num_layers=1, init="random", seed=3)
        student = StandaloneStudent(model)
        exporter = artifact_exporter(StandaloneConfig.for_target(target.model.config, num_layers=1,
                                                                 vocab_size=VOCAB))
    else:
        vocab = day0_draft_vocab(VOCAB, 48, frequencies=traffic_frequencies(traces, VOCAB))
        head = eagle_from_target(target.model, feature_layers=FEATURE_LAYERS, draft_vocab=vocab, init="random",
                                 seed=3)
        student = EagleStudent(head, depth=K)
        exporter = artifact_exporter(None)
    loop, reg = _loop(student, traces, tmp_path, fp, exporter)
    heldout = [t for t in traces if is_heldout(t.request_id, HELDOUT)]
    assert len(heldout) >= 8
    gate = GateConfig(k=K, hybrid=False)
    before = score(student, heldout, gate, None)
    for _ in range(3):
        loop.run_round()
    assert loop.stats.promotions >= 1, loop.stats.last_decision
    after = score(loop.champion, heldout, gate, None)
    assert after.expected_acceptance > before.expected_acceptance + 0.3, (before, after)
    assert after.sim_accept_len > before.sim_accept_len + 0.5, (before, after)
    assert {r.request_id for r in loop.replay.heldout} <= {r.request_id for r in heldout}  # never trained on

    # the registered champion loads back (validated) bit-identical to the promoted student
    model, meta = reg.load_champion("acme", fp)
    assert meta.kind == kind
    # ...recording the gate's held-out acceptance, which serving starts its estimate from
    assert before.expected_acceptance < meta.extra["heldout_acceptance"] <= 1.0
    # ...and the champion's on the same traces, whose ratio a successor's live estimate starts from
    assert 0.0 <= meta.extra["champion_heldout_acceptance"] <= meta.extra["heldout_acceptance"]
    promoted = loop.champion.model.state_dict()
    loaded = model.state_dict()
    assert loaded.keys() == promoted.keys()
    for name, tensor in loaded.items():
        assert tensor.dtype == promoted[name].dtype and torch.equal(tensor, promoted[name]), name
