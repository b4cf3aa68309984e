"""The day-0 drafter serving starts with and the trainer's first student, built from the target
(the closed loop, infra/loop.py, and ``specloop bench online``'s static baseline build them here).
Heavy imports stay inside the functions."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotation only: infra/loop.py imports this module
    from infra.loop import LoopConfig


class FrozenDrafter:
    """A drafter whose global state stops learning: finished outputs are not indexed."""

    def __init__(self, inner):
        self.inner = inner

    def remove_request(self, request_id, output_ids):
        self.inner.remove_request(request_id, None)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def day0_drafter(kind: str, target, draft_vocab_size: int | None = None, init: str = "target-layers",
                 selfspec: dict | None = None, artifact: str | None = None):
    """The drafter serving starts with. ``hybrid`` starts as the suffix drafter alone: an untrained
    learned drafter only costs draft time (day-0 acceptance ~0.01), so the learned half joins at
    the first promotion (the Swapper's loader wraps the running suffix drafter into the hybrid).
    With a pre-trained selfspec ``artifact``, the learned drafter (the hybrid's learned half) is
    that one from the first request."""
    from serving.drafters.factory import build_drafter

    if artifact is not None and kind == "hybrid":
        return build_drafter("hybrid", target, artifact, learned="selfspec")
    if artifact is not None and kind == "standalone":
        return build_drafter("selfspec", target, artifact)
    if kind == "hybrid":
        return build_drafter("suffix", target)
    if kind == "standalone" and init == "selfspec":
        return build_drafter("selfspec", target, draft_vocab_size=draft_vocab_size, **(selfspec or {}))
    if kind == "standalone":
        return build_drafter("standalone", target, draft_vocab_size=draft_vocab_size, init=init)
    return build_drafter(kind, target)


def learned_kind(cfg: LoopConfig) -> str:
    """The artifact kind the trainer publishes for this loop."""
    return "selfspec" if cfg.day0_init == "selfspec" or cfg.day0_artifact else "standalone"


def make_selfspec_student(target, draft_vocab_size: int | None = None, exit_layer: int = 2,
                          adapter_layers: int = 1, artifact: str | None = None):
    """The trainer's selfspec student: serving's day-0 selfspec drafter (the target's first
    ``exit_layer`` layers shared, adapter = a copy of the next layer), same draft vocabulary; or
    the adapter of a pre-trained ``artifact``."""
    from feedback.drafters.from_target import assemble, selfspec_adapter_from_target
    from feedback.drafters.vocab import day0_draft_vocab, special_token_ids
    from trainer.students import SelfSpecStudent, selfspec_student_from_artifact

    if artifact is not None:
        return selfspec_student_from_artifact(artifact, target.model, target.fingerprint)

    vocab = None
    if draft_vocab_size is not None:
        v = int(target.model.get_output_embeddings().weight.shape[0])
        vocab = day0_draft_vocab(v, draft_vocab_size, special_token_ids(target.tokenizer, target.model.config))
    adapter = selfspec_adapter_from_target(target.model, exit_layer=exit_layer, adapter_layers=adapter_layers,
                                           draft_vocab=vocab)
    return SelfSpecStudent(assemble(adapter.float(), target.model), adapter.config)


def make_student(target, draft_vocab_size: int | None = None, init: str = "target-layers"):
    """The trainer's student: serving's day-0 standalone drafter (the target's embeddings, first two
    layers, norm and lm_head), read at the same draft vocabulary serving uses; embeddings copied
    from the target stay frozen (and stay out of its artifacts), random ones train."""
    from feedback.drafters.standalone_lm import standalone_from_target
    from feedback.drafters.vocab import day0_draft_vocab, special_token_ids
    from feedback.registry.shared_tensors import shared_with_target
    from trainer.students import StandaloneStudent

    model = standalone_from_target(target.model, init=init).float()
    vocab = None
    if draft_vocab_size is not None:
        v = int(model.get_output_embeddings().weight.shape[0])
        vocab = day0_draft_vocab(v, draft_vocab_size, special_token_ids(target.tokenizer, target.model.config))
    student = StandaloneStudent(model, head_vocab=vocab, train_embeddings=init != "target-layers")
    student.from_target = shared_with_target(model, target.model)  # the frozen embedding: not in artifacts
    return student
