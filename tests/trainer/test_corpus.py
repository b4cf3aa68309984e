"""Day-0 training on package text: the corpus, its teacher-forced traces, and ``specloop train
--corpus`` / ``--init``."""

import numpy as np
import pytest
import torch

from feedback.registry.artifact import DrafterArtifactError, load_drafter, read_meta
from trainer.corpus import EXCLUDED_DISTRIBUTIONS, canonical_name, package_corpus
from trainer.offline import corpus_traces, teacher_trace


def test_corpus_has_code_and_prose_from_many_packages_and_none_of_the_evaluation_sets(target_dir):
    target, _ = target_dir
    chunks = package_corpus(target.tokenizer, 12, chunk_tokens=32, per_source=2)
    assert [c.domain for c in chunks].count("code") == 12 and [c.domain for c in chunks].count("prose") == 12
    assert all(len(c.ids) == 32 for c in chunks)
    for domain in ("code", "prose"):
        assert len({c.source for c in chunks if c.domain == domain}) >= 6  # at most 2 per source
    assert not {canonical_name(c.source.split(":")[0]) for c in chunks} & EXCLUDED_DISTRIBUTIONS
    again = package_corpus(target.tokenizer, 12, chunk_tokens=32, per_source=2)
    assert [c.ids for c in again] == [c.ids for c in chunks]  # seeded: the same corpus every run
    other = package_corpus(target.tokenizer, 12, chunk_tokens=32, per_source=2, seed=1)
    assert [c.source for c in other] != [c.source for c in chunks]
    typer_only = package_corpus(target.tokenizer, 2, chunk_tokens=32, distributions=["Typer"])
    assert {c.source.split(":")[0] for c in typer_only} == {"typer"}


def test_asking_for_more_text_than_is_installed_is_an_error(target_dir):
    target, _ = target_dir
    with pytest.raises(ValueError, match="installed packages gave"):
        package_corpus(target.tokenizer, 10**4, chunk_tokens=64, distributions=["typer"])


def test_batched_corpus_traces_equal_one_sequence_teacher_forcing(target_dir):
    target, _ = target_dir
    chunks = package_corpus(target.tokenizer, 3, chunk_tokens=24)
    seen = []
    records = corpus_traces(target.model, target.fingerprint, chunks, topk=5, batch_size=4, progress=seen.append)
    assert len(records) == 6 and sum(seen) == 6
    for c, r in zip(chunks, records):
        assert r.domain == c.domain and list(r.prompt_ids) == c.ids[:1] and list(r.output_ids) == c.ids[1:]
        assert r.steps.num_steps == len(c.ids) - 1  # a row with the target's top-k at every position
        one = teacher_trace(target.model, target.fingerprint, c.ids[:1], c.ids[1:], topk=5)
        assert np.array_equal(r.steps.target_topk_ids, one.steps.target_topk_ids)
        np.testing.assert_allclose(r.steps.target_topk_logprobs, one.steps.target_topk_logprobs, atol=1e-4)


def test_corpus_training_saves_a_drafter_that_a_later_run_starts_from(target_dir, tmp_path, selfspec_env):
    from trainer.cli import run_offline
    from trainer.students import selfspec_student_from_artifact

    target, d = target_dir
    pre = tmp_path / "pretrained"
    res = run_offline(str(d), None, pre, target.model_id, max_new_tokens=8, steps=4, corpus=6)
    assert res["traces"] == 12 and res["corpus_chunks"] == 12 and res["train_steps"] >= 1
    assert read_meta(pre).kind == "selfspec"

    # an artifact whose adapter differs from any day-0 copy of a target layer
    from feedback.registry.artifact import save_drafter
    from trainer.export import student_draft_vocab

    trained = selfspec_student_from_artifact(pre, target.model, target.fingerprint)
    with torch.no_grad():
        trained.model.model.layers[1].mlp.up_proj.weight.add_(0.5)
    moved = tmp_path / "moved"
    save_drafter(trained.model, trained.config, target.fingerprint, moved, version="moved",
                 draft_vocab=student_draft_vocab(trained))
    adapter, _ = load_drafter(moved, target.fingerprint)
    student = selfspec_student_from_artifact(moved, target.model, target.fingerprint)
    layer = student.model.model.layers[1]  # the first adapter layer (exit layer 1)
    assert torch.equal(layer.mlp.up_proj.weight, adapter.layers[0].mlp.up_proj.weight.float())
    assert not torch.equal(layer.mlp.up_proj.weight, target.model.model.layers[1].mlp.up_proj.weight)
    assert student.model.model.layers[0] is target.model.model.layers[0]  # shared, not copied
    assert torch.equal(student.head_vocab, adapter.draft_vocab)

    res2 = run_offline(str(d), None, tmp_path / "again", target.model_id, max_new_tokens=8, steps=2, corpus=3,
                       init=pre)
    assert res2["init"] == str(pre) and read_meta(tmp_path / "again").extra["init"] == str(pre)


def test_init_refuses_an_artifact_of_another_target(target_dir, tmp_path, selfspec_env):
    from trainer.cli import run_offline
    from trainer.students import selfspec_student_from_artifact

    target, d = target_dir
    pre = tmp_path / "pretrained"
    run_offline(str(d), None, pre, target.model_id, max_new_tokens=8, steps=1, corpus=2)
    other = target.fingerprint.model_copy(update={"model_id": "another-model"})
    with pytest.raises(DrafterArtifactError, match="refusing"):
        selfspec_student_from_artifact(pre, target.model, other)


def test_corpus_traces_are_cached_per_target_and_text(target_dir, tmp_path):
    from trainer.offline import cached_corpus_traces

    target, _ = target_dir
    chunks = package_corpus(target.tokenizer, 2, chunk_tokens=16)
    first = cached_corpus_traces(target.model, target.fingerprint, chunks, tmp_path)
    assert len(list(tmp_path.glob("corpus-*.traces"))) == 1
    again = cached_corpus_traces(None, target.fingerprint, chunks, tmp_path)  # read back: no target needed
    assert [list(r.output_ids) for r in again] == [list(r.output_ids) for r in first]
    assert np.array_equal(again[0].steps.target_topk_ids, first[0].steps.target_topk_ids)
    other = target.fingerprint.model_copy(update={"model_id": "another-model"})
    with pytest.raises(TypeError):  # another target misses the cache and needs its model
        cached_corpus_traces(None, other, chunks, tmp_path)


def test_init_of_another_kind_is_refused_before_any_work(target_dir, tmp_path, monkeypatch):
    import typer

    from trainer.cli import run_offline

    target, d = target_dir
    monkeypatch.setenv("SPECLOOP_TRAINER_DRAFTER", "standalone")
    with pytest.raises(typer.BadParameter, match="selfspec"):
        run_offline(str(d), None, tmp_path / "x", target.model_id, max_new_tokens=8, steps=1, corpus=2,
                    init=tmp_path / "whatever")
    assert not (tmp_path / "x").exists()
