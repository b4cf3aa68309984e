"""A promoted standalone drafter is served at the draft vocabulary its student trained at: the
trainer's exporter records it in the artifact and serving's loader reads the lm_head at it."""

import torch

from infra.day0 import make_student
from kernels.packed_linear import PackedLinear
from serving.artifact_loader import ArtifactDrafterLoader
from serving.target import tiny_target
from trainer.export import artifact_exporter


def test_served_drafter_reads_the_students_draft_vocabulary(tmp_path):
    from feedback.drafters.standalone_lm import StandaloneConfig

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
        head = _served_head(net)
        assert head.shape == (128, w.shape[1])
        # served rounded (a draft's numerics move acceptance only): the rows' int8 quantisation
        # on the packed path (DRAFT_INT8), their bf16 roundings on the module path
        rows = w[student.head_vocab].detach()
        served = getattr(getattr(net, "forward", None), "lm_head_served", None)
        if getattr(served, "layout", None) == "int8":
            expected = PackedLinear.pack_int8(rows.float()).unpacked()
        else:
            expected = rows.bfloat16().float()
        assert torch.equal(head.float(), expected)


def _served_head(net) -> torch.Tensor:
    """The lm_head rows a learned drafter's net reads: the packed forward's panels (unpacked), or
    the module path's bf16 copy."""
    if hasattr(net, "head_weight"):
        return net.head_weight
    served = net.forward.lm_head_served
    return served.unpacked() if hasattr(served, "unpacked") else served
