"""The AROUND hook on eagle_sample, driven with synthetic SGLang-shaped objects on the CPU."""

from __future__ import annotations

import sys
import tomllib
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from sglang_fakes import logits_preferring, make_verify_step

from serving.sglang import plugin
from serving.sglang.contract import HOOK_TARGET, PLUGIN_GROUP
from serving.sglang.exporter import ENV_ADDRESS, ENV_AUTHKEY
from serving.sglang.plugin import TraceCapture, request_sampled
from serving.sglang.reduction import unpack_step

ROOT = Path(__file__).resolve().parents[3]
CHAIN = [-1, 0, 1, 2]


class RecordingExporter:
    def __init__(self):
        self.steps = []

    def submit(self, packed, layout, request_ids, prompt_lens):
        self.steps.append((unpack_step(packed.numpy(), layout), request_ids, prompt_lens))


def chain_step(targets=((11, 30, 31, 32), (21, 22, 23, 40))):
    tokens = [[7, 11, 12, 13], [8, 21, 22, 23]]
    logits = logits_preferring([list(t) for t in targets], 50)
    return make_verify_step(tokens, CHAIN, logits, seq_lens=[10, 20], topk=1, depth=3)


def test_hook_returns_the_original_result_and_exports_the_step():
    verify_input, batch, logits_output, result = chain_step()
    calls = []

    def original(*args, **kwargs):
        calls.append((args, kwargs))
        logits_output.next_token_logits.add_(100.0 * torch.rand_like(
            logits_output.next_token_logits))  # in-place penalties, as eagle_sample does
        return result

    raw = logits_output.next_token_logits.clone()
    exporter = RecordingExporter()
    capture = TraceCapture(exporter, sample_rate=1.0, top_k=4)
    out = capture.around(original, (verify_input, batch, logits_output), {"grammar_mask": None})

    assert out is result
    assert len(calls) == 1 and calls[0][1] == {"grammar_mask": None}
    (rows, rids, prompt_lens), = exporter.steps
    assert rids == ["req-0", "req-1"] and prompt_lens == [9, 19]
    assert rows.num_accepted.tolist() == [1, 3]
    # recorded top-k is the model's distribution from before the in-place edits
    expected = raw.view(2, 4, -1).log_softmax(-1).topk(4).indices
    np.testing.assert_array_equal(rows.target_topk_ids, expected.numpy())


def test_keyword_arguments_are_bound_too():
    verify_input, batch, logits_output, result = chain_step()
    exporter = RecordingExporter()
    TraceCapture(exporter, top_k=2).around(
        lambda **kw: result, (), {"verify_input": verify_input, "batch": batch,
                                  "logits_output": logits_output})
    assert len(exporter.steps) == 1


def test_sampling_keeps_whole_requests_and_skips_unsampled_steps():
    assert request_sampled("anything", 1.0)
    assert not request_sampled("anything", 0.0)
    rids = [f"r{i}" for i in range(2000)]
    kept = sum(request_sampled(r, 0.25) for r in rids)
    assert 400 < kept < 600
    assert [request_sampled(r, 0.25) for r in rids] == [request_sampled(r, 0.25) for r in rids]

    verify_input, batch, logits_output, result = chain_step()
    exporter = RecordingExporter()
    out = TraceCapture(exporter, sample_rate=0.0).around(
        lambda *a, **k: result, (verify_input, batch, logits_output), {})
    assert out is result and exporter.steps == []


def test_only_sampled_rows_are_reduced(monkeypatch):
    verify_input, batch, logits_output, result = chain_step()
    monkeypatch.setattr(plugin, "request_sampled", lambda rid, rate: rid == "req-1")
    exporter = RecordingExporter()
    TraceCapture(exporter, top_k=3).around(lambda *a: result, (verify_input, batch,
                                                               logits_output), {})
    (rows, rids, _), = exporter.steps
    assert rids == ["req-1"] and rows.num_accepted.tolist() == [3]
    assert rows.emitted == [[21, 22, 23, 40]]


def test_idle_batches_are_not_captured():
    verify_input, batch, logits_output, result = chain_step()
    batch.forward_mode.is_idle = lambda: True
    exporter = RecordingExporter()
    TraceCapture(exporter).around(lambda *a: result, (verify_input, batch, logits_output), {})
    assert exporter.steps == []


def test_a_capture_failure_never_breaks_the_verify_step(caplog):
    verify_input, batch, logits_output, result = chain_step()
    del verify_input.draft_token_num  # SGLang changed under us
    exporter = RecordingExporter()
    capture = TraceCapture(exporter)
    out = capture.around(lambda *a: result, (verify_input, batch, logits_output), {})
    assert out is result and not capture.enabled and exporter.steps == []
    assert "trace capture failed" in caplog.text
    assert capture.around(lambda *a: "next", (verify_input, batch, logits_output), {}) == "next"


def test_register_is_a_no_op_without_a_trace_channel(monkeypatch):
    monkeypatch.delenv(ENV_ADDRESS, raising=False)
    monkeypatch.setitem(sys.modules, "sglang", None)  # any sglang import would raise
    plugin.register()


def test_register_adds_an_around_hook_on_eagle_sample(monkeypatch):
    registered = []
    hook_registry = types.ModuleType("sglang.srt.plugins.hook_registry")
    hook_registry.HookType = types.SimpleNamespace(AROUND="around")
    hook_registry.HookRegistry = types.SimpleNamespace(
        register=lambda target, hook, hook_type: registered.append((target, hook, hook_type)))
    for name in ("sglang", "sglang.srt", "sglang.srt.plugins"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.plugins.hook_registry", hook_registry)
    monkeypatch.setenv(ENV_ADDRESS, "/tmp/nowhere.sock")
    monkeypatch.setenv(ENV_AUTHKEY, "00")

    plugin.register()
    assert registered == [(HOOK_TARGET, plugin.around_eagle_sample, "around")]


def test_entry_point_is_declared_and_resolves():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    group = project["entry-points"][PLUGIN_GROUP]
    assert list(group.values()) == ["serving.sglang.plugin:register"]
    module, attr = group["specloop"].split(":")
    assert getattr(__import__(module, fromlist=[attr]), attr) is plugin.register


@pytest.fixture(autouse=True)
def _fresh_process_capture(monkeypatch):
    monkeypatch.setattr(plugin, "_capture", None)
