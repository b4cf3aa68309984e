"""`specloop train --offline` loads the target's weights once: the model that answered the prompts
is the one the student is built from. It was loaded a second time for the student (twice the
memory and load time of the target, minutes for a large one)."""

from __future__ import annotations

import json

import pytest


@pytest.mark.parametrize("drafter", ["selfspec", "standalone"])
def test_the_targets_weights_load_once(drafter, target_dir, tmp_path, monkeypatch, selfspec_env):
    import transformers

    import trainer.offline
    from trainer.cli import run_offline

    monkeypatch.setenv("SPECLOOP_TRAINER_DRAFTER", drafter)
    target, d = target_dir
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "def add(a, b):"}) + "\n")
    loads, real = [], transformers.AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: loads.append(a[0]) or real(*a, **k))
    fits = []  # the fit itself is not the point: the traces it is given are
    monkeypatch.setattr(trainer.offline, "train_offline",
                        lambda student, records, *a, **k: fits.append(records) or {"heldout_acceptance": 0.0})

    result = run_offline(str(d), prompts, tmp_path / "out", target.model_id, max_new_tokens=4, steps=1,
                         corpus_cache=tmp_path / "cache")

    assert loads == [str(d)], loads
    assert len(fits[0]) == 1 and result["drafter"] == drafter and (tmp_path / "out" / "config.json").is_file()
