"""Scheduler-side exporter to engine-side collector over the real Unix-socket channel (CPU)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from sglang_fakes import logits_preferring, make_verify_step

from feedback.bus.trace import DrafterKind
from serving.sglang.collector import TraceCollector, to_verify_batch
from serving.sglang.exporter import ExportConfig, StepExporter
from serving.sglang.reduction import StepLayout, from_sglang, reduce_verify_step, summarize_target


def packed_chain_step():
    tokens = [[7, 11, 12, 13], [8, 21, 22, 23]]
    logits = logits_preferring([[11, 30, 31, 32], [21, 22, 23, 40]], 50)
    vi, batch, _, (predict, lens, index) = make_verify_step(
        tokens, [-1, 0, 1, 2], logits, seq_lens=[10, 20], topk=1, depth=3)
    step = from_sglang(vi, predict, lens, index)
    packed = reduce_verify_step(step, *summarize_target(logits, 4))
    return packed, StepLayout(3, 4), [r.rid for r in batch.reqs], [9, 15]


def wait_for(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


def test_steps_arrive_as_verify_batches():
    received = []
    collector = TraceCollector(received.append)
    env = collector.env()
    exporter = StepExporter(ExportConfig.from_env(env))
    try:
        packed, layout, rids, prompt_lens = packed_chain_step()
        before = time.monotonic()
        exporter.submit(packed, layout, rids, prompt_lens)
        assert wait_for(lambda: received)
        assert before <= received[0].hooked_at <= time.monotonic()  # when the hook ran
    finally:
        exporter.close()
        collector.close()

    batch = to_verify_batch(received[0], DrafterKind.STANDALONE, "v3")
    assert batch.request_ids == ["req-0", "req-1"]
    # output index root + 1 - prompt_len, minus the prefill-sampled first token
    assert batch.positions.tolist() == [10 - 9, 20 - 15]
    assert batch.num_drafted.dtype == np.int16 and batch.num_accepted.tolist() == [1, 3]
    assert batch.source.tolist() == [DrafterKind.STANDALONE] * 2
    assert batch.emitted == [[11, 30], [21, 22, 23, 40]]
    assert batch.target_topk_ids.shape == (2, 4, 4)
    assert batch.target_topk_logprobs.dtype == np.float16
    assert batch.drafter_version == "v3"
    assert batch.draft_ms is None and batch.verify_ms is None  # not measured: no fake 0 ms
    assert exporter.sent == 1 and exporter.shed == 0


def test_a_wrong_key_sheds_steps_without_raising():
    received = []
    collector = TraceCollector(received.append)
    config = ExportConfig(address=collector.address, authkey=b"not the key")
    exporter = StepExporter(config)
    try:
        exporter.submit(*packed_chain_step())
        assert wait_for(lambda: exporter.shed == 1)
    finally:
        exporter.close()
        collector.close()
    assert received == [] and exporter.sent == 0


def test_a_full_queue_sheds_instead_of_blocking():
    release = threading.Event()

    def stuck_connect(*args, **kwargs):
        release.wait(5)
        raise OSError("engine gone")

    exporter = StepExporter(ExportConfig(address="/nowhere", authkey=b"", max_queue=1),
                            connect=stuck_connect)
    step = packed_chain_step()
    start = time.monotonic()
    for _ in range(5):
        exporter.submit(*step)
    assert time.monotonic() - start < 1.0
    assert exporter.shed >= 3
    release.set()
    exporter.close()


def test_host_copy_of_a_cpu_step_is_independent():
    from serving.sglang.exporter import copy_to_host

    packed = torch.arange(6, dtype=torch.int32).reshape(2, 3)
    host, ready = copy_to_host(packed)
    packed.zero_()
    assert ready is None and host.tolist() == [[0, 1, 2], [3, 4, 5]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_host_copy_of_a_gpu_step_waits_on_its_event():
    from serving.sglang.exporter import copy_to_host

    packed = torch.arange(12, dtype=torch.int32, device="cuda").reshape(3, 4)
    host, ready = copy_to_host(packed)
    ready.synchronize()
    assert host.is_pinned() and host.tolist() == packed.cpu().tolist()
