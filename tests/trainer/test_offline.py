"""``specloop train --offline``: target responses -> traces -> distilled static drafter artifact."""

import json

import numpy as np
import pytest
import torch

from feedback.registry.artifact import DrafterArtifactError, read_meta
from serving.drafters import build_drafter
from serving.target import tiny_target
from trainer.examples import build_examples
from trainer.offline import generate_traces, read_prompts


def prompts_file(tmp_path, n=10):
    rows = [{"messages": [{"role": "user", "content": f"Write function number {i}."}], "domain": "code"}
            for i in range(n)]
    rows.append({"prompt": "def add(a, b):", "domain": "code"})
    p = tmp_path / "p.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows))
    return p


def test_bad_prompt_rows_name_their_line(target_dir, tmp_path):
    target, _ = target_dir
    p = tmp_path / "bad.jsonl"
    p.write_text('{"prompt": "x"}\n{"nothing": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        read_prompts(p, target.tokenizer)


def test_traces_carry_the_targets_greedy_choice_at_every_output_position(target_dir, tmp_path):
    target, _ = target_dir
    items = read_prompts(prompts_file(tmp_path, 3), target.tokenizer)
    records = generate_traces(target.model, target.tokenizer, target.fingerprint, items, max_new_tokens=12)
    assert len(records) == len(items)
    for r in records:
        assert r.domain == "code" and len(r.output_ids) == r.steps.num_steps
        top1 = r.steps.target_topk_ids[:, 0, 0]  # [T] the target's argmax at each position
        assert np.array_equal(top1, r.output_ids)  # greedy generate and teacher forcing agree
        main = build_examples(r)[0]
        assert main.num_rows == len(r.output_ids)


def test_offline_training_saves_a_selfspec_drafter_serving_loads(target_dir, tmp_path, selfspec_env):
    from trainer.cli import run_offline

    target, d = target_dir
    out = tmp_path / "static"
    res = run_offline(str(d), prompts_file(tmp_path), out, target.model_id, max_new_tokens=8, steps=6)
    assert res["traces"] == 11 and res["heldout_traces"] >= 1 and res["train_steps"] >= 1
    meta = read_meta(out)
    assert meta.kind == "selfspec" and meta.version == res["version"]
    drafter = build_drafter("selfspec", target, out)
    assert drafter.version == res["version"] and drafter.model.selfspec_draft_vocab.numel() == 4096
    with torch.no_grad():
        drafter.model(torch.tensor([[1, 2, 3]]))
    other = tiny_target(num_layers=4, seed=0, tokenizer=target.tokenizer)
    other.fingerprint = other.fingerprint.model_copy(update={"model_id": "another-model"})
    with pytest.raises(DrafterArtifactError, match="refusing"):
        build_drafter("selfspec", other, out)
