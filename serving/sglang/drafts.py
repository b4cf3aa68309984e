"""Drafters as SGLangEngine installs them, and the Swapper's loader for SGLang.

SGLang owns the draft model; specloop only replaces its weights (draft-only weight session, see
draft_weights.py). So a "drafter" here is a set of named tensors under SGLang's names, read either
from an SGLang-layout directory (the day-0 draft the engine starts with, kept so that a rollback can
reinstall it) or converted from a trainer artifact (``feedback.registry.artifact``: validated against the
target fingerprint, checksums, shapes and finite weights before anything reaches the GPU).

``SGLangDraftLoader`` has the interface of serving.artifact_loader.ArtifactDrafterLoader
(``load(dir, current)``), so the shared Swapper drives SGLang swaps and rollbacks unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from feedback.registry.artifact_keys import trace_times
from serving.sglang.draft_weights import NamedTensors, read_draft_tensors


@dataclass
class SGLangDraft:
    kind: str
    """eagle (SGLang EAGLE3) | standalone (SGLang STANDALONE)"""
    version: str
    path: Path | None = None
    """SGLang-layout directory the tensors are read from (when ``tensors`` is None)."""
    tensors: NamedTensors | None = None
    """Tensors under SGLang's names, already in memory."""
    trace_times: dict[str, float] = field(default_factory=dict)
    """When the requests of the traces it was first trained on finished (its artifact's, as a
    TorchEngine drafter's: serving.registry_records.trace_times); the Swapper's freshness figures."""

    def named_tensors(self) -> NamedTensors:
        if self.tensors is not None:
            return self.tensors
        if self.path is None:
            raise ValueError(f"drafter {self.version}: neither tensors nor a directory")
        return read_draft_tensors(self.path)


def artifact_tensors(model, kind: str) -> NamedTensors:
    """A validated artifact model's tensors under SGLang's names."""
    if kind == "eagle":
        from feedback.registry.eagle3_export import eagle3_state

        return sorted(eagle3_state(model).items())  # EagleHead names are EAGLE3's already
    # standalone: a transformers LlamaForCausalLM, whose names SGLang's Llama loader reads
    return sorted((n, t.detach().cpu().contiguous()) for n, t in model.state_dict().items())


def check_compatible(new: NamedTensors, current: NamedTensors) -> None:
    """A draft-only update can replace weights, not change the draft's architecture: every tensor
    both share must keep its shape. Raises ValueError (the Swapper counts it as refused)."""
    shapes = {name: tuple(t.shape) for name, t in current}
    common = [name for name, _ in new if name in shapes]
    if not common:
        raise ValueError("no tensor name in common with the served draft: not the same "
                         "architecture or layout")
    wrong = [f"{name}: {tuple(t.shape)} vs served {shapes[name]}" for name, t in new
             if name in shapes and tuple(t.shape) != shapes[name]]
    if wrong:
        raise ValueError(f"tensor shapes differ from the served draft: {wrong}")


class SGLangDraftLoader:
    """Builds an SGLangDraft from a trainer artifact for ``engine`` (an SGLangEngine)."""

    def __init__(self, engine):
        self.engine = engine
        self._target_tensors = None

    def target_tensors(self):
        """The target checkpoint's tensors (what an artifact may leave to the target), read from
        the model directory when an artifact asks: SGLang holds the weights, not this process."""
        if self._target_tensors is None:
            from feedback.registry.shared_tensors import CheckpointTensors, TargetTensors

            self._target_tensors = TargetTensors(CheckpointTensors(self.engine.config.model_path))
        return self._target_tensors

    def load(self, artifact_dir: Path, current=None) -> SGLangDraft:
        from feedback.registry.artifact import load_drafter, read_meta

        fingerprint = self.engine.fingerprint
        if fingerprint is None:
            raise ValueError("the SGLang engine has not loaded its target's metadata yet")
        shared = self.target_tensors() if read_meta(artifact_dir).from_target else None
        model, meta = load_drafter(artifact_dir, fingerprint, target_tensors=shared)  # DrafterArtifactError on problems
        kind = self.engine.drafter.kind
        if meta.kind != kind:
            raise ValueError(f"artifact is a {meta.kind} drafter, SGLang serves a {kind} draft "
                             "(the speculative algorithm is fixed at launch)")
        tensors = artifact_tensors(model, meta.kind)
        current = current if current is not None else self.engine.drafter
        if isinstance(current, SGLangDraft) and (current.tensors is not None or current.path):
            check_compatible(tensors, current.named_tensors())
        return SGLangDraft(kind=kind, version=meta.version, tensors=tensors,
                           trace_times=trace_times(meta.extra))
