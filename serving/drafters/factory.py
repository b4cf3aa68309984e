"""``build_drafter``: a Drafter of any kind for a loaded target, from an artifact or at day 0."""

from __future__ import annotations

from pathlib import Path

from feedback.drafters.defaults import (
    SELFSPEC_ADAPTER_LAYERS,
    SELFSPEC_DRAFT_VOCAB_SIZE,
    SELFSPEC_EXIT_LAYER,
)
from feedback.registry.artifact_keys import (
    DAY0_VERSION,
    EXTRA_CHAMPION_HELDOUT_ACCEPTANCE,
    EXTRA_HELDOUT_ACCEPTANCE,
    trace_times,
)
from serving.drafters.base import Drafter
from serving.target import Target

KINDS = ("suffix", "eagle", "standalone", "selfspec", "hybrid")


def build_drafter(
    kind: str, target: Target, artifact_dir: str | Path | None = None, **options
) -> Drafter:
    """Options by kind (unknown ones raise TypeError):

    - suffix: ``config`` (SuffixConfig) or SuffixConfig fields.
    - eagle: ``draft_vocab_size`` (16384), ``feature_layers`` (HF hidden_states indices; default
      (2, L//2, L-3)), ``init`` ("target" | "random"), ``frequencies`` ([V] counts picking the
      draft vocabulary), ``seed``. Ignored shape options when an artifact is given.
    - standalone: ``num_layers`` (2), ``init`` ("target-layers" | "random"), ``seed``,
      ``draft_vocab_size`` (None: full vocabulary; else read the lm_head for the lowest ids only;
      an artifact that records the draft vocabulary it was trained at is served at that one).
    - selfspec: ``exit_layer`` (2: target layers shared), ``adapter_layers`` (1), ``adapter_init``
      ("next" | "last"), ``draft_vocab_size`` (8192 lowest ids + specials, as the trainer's
      student: feedback/drafters/defaults.py; None: full vocabulary).
    - hybrid: ``learned`` ("eagle" | "standalone" | "selfspec"; default: the artifact's kind, else eagle),
      ``learned_options`` (dict, as above), ``suffix`` (an existing suffix drafter to keep its
      index across a swap) or ``suffix_options`` (dict), ``policy`` (HybridPolicy or dict),
      ``predecessor`` (the drafter it replaces at a swap, a hybrid or the suffix drafter a day-0
      hybrid is: serving's estimate goes on from it, and a promoted learned half's acceptance
      estimate starts from a predecessor hybrid's live one).

    Every learned kind (eagle, standalone, selfspec) also takes ``branches``: candidates per drafted
    position (1: chains; default ``LearnedDrafter.branches``; serving/drafters/draft_tree.py).

    With ``artifact_dir`` the learned model is loaded through feedback.registry.artifact.load_drafter, which
    refuses an artifact built for another target.
    """
    if kind == "suffix":
        return _suffix(target, options)
    learned = {"eagle": _eagle, "standalone": _standalone, "selfspec": _selfspec}.get(kind)
    if learned is not None:
        branches = options.pop("branches", None)
        drafter = learned(target, artifact_dir, **options)
        if branches is not None:
            if int(branches) < 1:
                raise ValueError(f"branches must be >= 1, got {branches}")
            drafter.branches = int(branches)
        return drafter
    if kind == "hybrid":
        return _hybrid(target, artifact_dir, **options)
    raise ValueError(f"unknown drafter kind {kind!r}: one of {', '.join(KINDS)}")


def _suffix(target: Target, options: dict):
    from feedback.suffix.seed import read_seed
    from serving.drafters.suffix import SuffixConfig, SuffixDrafter

    config = options.pop("config", None) or SuffixConfig(**options)
    if config.seed_file is not None and config.use_global_index:
        read_seed(config.seed_file, target.fingerprint)  # another target's answers: refused
    return SuffixDrafter(config)


def _load(target: Target, artifact_dir, kind: str):
    from feedback.registry.artifact import load_drafter

    model, meta = load_drafter(
        artifact_dir, expected_fingerprint=target.fingerprint, device=target.device,
        target_tensors=target.tensors,
    )
    if meta.kind != kind:
        raise ValueError(f"{artifact_dir} holds a {meta.kind} drafter, not {kind}")
    return model.to(target.model.get_output_embeddings().weight.dtype), meta


def _measured(drafter, meta):
    """``drafter`` with the held-out acceptance its artifact records (the trainer's gate, or
    ``specloop train``), where serving's acceptance estimate for it starts, and its ratio to the
    predecessor's on the same traces (the gate's champion), from which a successor starts instead
    where its predecessor's live estimate is known; and ``trace_times``, when the requests of the
    traces it was the first version trained on finished (trainer/lineage.py)."""
    from feedback.goodput import held_out_ratio

    def fraction(key):
        value = meta.extra.get(key)
        return float(value) if isinstance(value, (int, float)) and 0.0 <= value <= 1.0 else None

    value = fraction(EXTRA_HELDOUT_ACCEPTANCE)
    if value is not None:
        drafter.prior_acceptance = value
        drafter.prior_relative = held_out_ratio(value, fraction(EXTRA_CHAMPION_HELDOUT_ACCEPTANCE))
    times = trace_times(meta.extra)
    if times:  # when its newest traces' requests finished: the Swapper's freshness figures
        drafter.trace_times = times
    return drafter


def _eagle(
    target: Target,
    artifact_dir=None,
    *,
    draft_vocab_size: int | None = None,
    feature_layers=None,
    init: str = "target",
    frequencies=None,
    seed: int = 0,
):
    from feedback.drafters.eagle_head import check_target, eagle_from_target
    from feedback.drafters.vocab import (
        DEFAULT_DRAFT_VOCAB_SIZE,
        day0_draft_vocab,
        special_token_ids,
    )
    from serving.drafters.eagle import EagleDrafter

    if artifact_dir is not None:
        head, meta = _load(target, artifact_dir, "eagle")
        check_target(head.config, target.model)
        head.attach_embeddings(target.model.get_input_embeddings().weight)
        return _measured(EagleDrafter(head, version=meta.version), meta)
    vocab = int(target.model.get_output_embeddings().weight.shape[0])
    specials = special_token_ids(target.tokenizer, target.model.config)
    draft_vocab = day0_draft_vocab(
        vocab, draft_vocab_size or DEFAULT_DRAFT_VOCAB_SIZE, specials, frequencies
    )
    head = eagle_from_target(
        target.model, feature_layers=feature_layers, draft_vocab=draft_vocab, init=init, seed=seed
    )
    return EagleDrafter(head.to(target.device), version=DAY0_VERSION)


def _standalone(
    target: Target,
    artifact_dir=None,
    *,
    num_layers: int = 2,
    init: str = "target-layers",
    seed: int = 0,
    draft_vocab_size: int | None = None,
):
    from feedback.drafters.standalone_lm import standalone_from_target
    from feedback.drafters.vocab import day0_draft_vocab, special_token_ids
    from feedback.registry.shared_tensors import equal_target_tensors, share
    from serving.drafters.standalone import StandaloneDrafter

    meta = None
    if artifact_dir is not None:
        model, meta = _load(target, artifact_dir, "standalone")
        version = meta.version
    else:
        model, version = (
            standalone_from_target(target.model, num_layers=num_layers, init=init, seed=seed),
            DAY0_VERSION,
        )
        share(model, equal_target_tensors(model, target.model))  # copies of the target's: held once
    draft_vocab = getattr(model, "artifact_draft_vocab", None)  # what the student was trained at
    if draft_vocab is None and draft_vocab_size is not None:
        vocab = int(model.get_output_embeddings().weight.shape[0])
        draft_vocab = day0_draft_vocab(
            vocab, draft_vocab_size, special_token_ids(target.tokenizer, target.model.config)
        )
    drafter = StandaloneDrafter(model.to(target.device), version=version, draft_vocab=draft_vocab)
    return drafter if meta is None else _measured(drafter, meta)


def _selfspec(
    target: Target,
    artifact_dir=None,
    *,
    exit_layer: int = SELFSPEC_EXIT_LAYER,
    adapter_layers: int = SELFSPEC_ADAPTER_LAYERS,
    adapter_init: str = "next",
    draft_vocab_size: int | None = SELFSPEC_DRAFT_VOCAB_SIZE,
):
    from feedback.drafters.from_target import assemble, selfspec_adapter_from_target
    from feedback.drafters.vocab import day0_draft_vocab, special_token_ids
    from serving.drafters.standalone import SelfSpecDrafter

    if artifact_dir is not None:
        adapter, meta = _load(target, artifact_dir, "selfspec")
        return _measured(
            SelfSpecDrafter(assemble(adapter, target.model), version=meta.version, target=target.model), meta
        )
    vocab = None
    if draft_vocab_size is not None:
        size = int(target.model.get_output_embeddings().weight.shape[0])
        specials = special_token_ids(target.tokenizer, target.model.config)
        vocab = day0_draft_vocab(size, draft_vocab_size, specials)
    adapter = selfspec_adapter_from_target(
        target.model, exit_layer=exit_layer, adapter_layers=adapter_layers,
        adapter_init=adapter_init, draft_vocab=vocab,
    )
    return SelfSpecDrafter(assemble(adapter, target.model), version=DAY0_VERSION, target=target.model)


def _hybrid(
    target: Target,
    artifact_dir=None,
    *,
    learned: str | None = None,
    learned_options: dict | None = None,
    suffix=None,
    suffix_options: dict | None = None,
    policy=None,
    predecessor=None,
):
    from feedback.registry.artifact import read_meta
    from serving.drafters.hybrid import HybridDrafter, HybridPolicy

    if learned is None:
        learned = read_meta(artifact_dir).kind if artifact_dir is not None else "eagle"
    if learned not in ("eagle", "standalone", "selfspec"):
        raise ValueError(
            f"hybrid: learned drafter must be eagle, standalone or selfspec, not {learned!r}"
        )
    learned_drafter = build_drafter(learned, target, artifact_dir, **(learned_options or {}))
    suffix_drafter = suffix if suffix is not None else _suffix(target, dict(suffix_options or {}))
    if isinstance(policy, dict):
        policy = HybridPolicy(**policy)
    return HybridDrafter(suffix_drafter, learned_drafter, policy, predecessor=predecessor)
