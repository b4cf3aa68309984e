"""A promoted standalone drafter is served at the draft vocabulary its student trained at: the
trainer's exporter records it in the artifact and serving's loader reads the lm_head at it."""

import torch

from infra.loop import make_student
from serving.swap import ArtifactDrafterLoader
from serving.target import tiny_target
from trainer.export import artifact_exporter


def test_served_drafter_reads_the_students_draft_vocabulary(tmp_path):
    from feedback.drafters.models import StandaloneConfig

    target = tiny_target(vocab_size=300, hidden_size=64, num_layers=4)
    student = make_student(target, draft_vocab_size=128)
    export = artifact_exporter(StandaloneConfig.for_target(target.model.config))
    export(student, tmp_path / "v1", target.fingerprint)

    for kind in ("standalone", "hybrid"):
        drafter = ArtifactDrafterLoader(target, kind).load(tmp_path / "v1")
        learned = drafter.learned if kind == "hybrid" else drafter
        net = learned.net
        assert torch.equal(net.vocab_map, student.head_vocab)
        w = student.model.get_output_embeddings().weight
        assert net.head_weight.shape == (128, w.shape[1])
        assert torch.equal(net.head_weight, w[student.head_vocab].to(net.head_weight.dtype))
