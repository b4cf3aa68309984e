"""A live TorchEngine (tiny model, suffix drafter) exporting traces through a real tansu broker.

TraceRecorder -> Tee(KafkaTraceSink, in-memory copy) -> broker -> KafkaTraceSource: what the
trainer reads is exactly what the recorder built, once per finished train=True request; and a
broker outage in the middle of serving costs traces (counted), never requests.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import pytest
import torch
from trace_samples import assert_same_trace

from feedback.bus.kafka_sink import KafkaTraceSink
from feedback.bus.kafka_source import KafkaTraceSource
from feedback.bus.trace import TraceRecord
from serving.drafters.factory import build_drafter
from serving.engine.base import GenerationRequest, SamplingParams
from serving.engine.config import EngineConfig
from serving.engine.torch_engine import TorchEngine
from serving.observers import TraceRecorder
from serving.target import tiny_target

pytestmark = pytest.mark.integration

FAST_GROUP = {"session_timeout_ms": 2_000, "heartbeat_interval_ms": 500}
TEXTS = [
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "The cat sat on the mat. The cat sat on the mat. The dog sat on the",
    "Write a haiku about the sea, the sea, the sea and the shore.",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,",
    "Explain speculative decoding in two sentences.",
    "import numpy as np\nimport numpy as np\nx = np.zeros(3)\ny = np.",
]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 shared cores; the tiny model gains nothing from more
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def target():
    return tiny_target()  # real SmolLM2 tokenizer (vocab 49,152), random 2-layer Llama


@pytest.fixture(scope="module")
def prompts(target) -> list[list[int]]:
    return [list(target.tokenizer.encode(t)) for t in TEXTS]


class TeeSink:
    """Hands the very record object the recorder built to the Kafka sink and keeps it here."""

    def __init__(self, sink: KafkaTraceSink):
        self.sink = sink
        self.built: dict[str, TraceRecord] = {}
        self.duplicates = 0
        self._lock = threading.Lock()

    def emit(self, record: TraceRecord) -> None:
        with self._lock:
            self.duplicates += record.request_id in self.built
            self.built[record.request_id] = record
        self.sink.emit(record)

    def close(self) -> None:
        self.sink.close()


def fast_sink(bootstrap: str, topic: str, **kw) -> KafkaTraceSink:
    config = {"linger_ms": 5, "request_timeout_ms": 2_000, "delivery_timeout_ms": 3_000,
              "max_block_ms": 500, "bootstrap_timeout_ms": 1_000, "reconnect_backoff_s": 0.3}
    return KafkaTraceSink(bootstrap_servers=bootstrap, topic=topic, **{**config, **kw})


def fresh_source(bootstrap: str, topic: str) -> KafkaTraceSource:
    return KafkaTraceSource(bootstrap_servers=bootstrap, topic=topic, dlq_topic=f"{topic}.dlq",
                            group_id=f"trainer-{uuid.uuid4().hex[:8]}", **FAST_GROUP)


def consume(source: KafkaTraceSource, n: int, timeout: float = 20.0) -> list[TraceRecord]:
    """At least ``n`` records if they come within ``timeout``, then whatever else is there."""
    got, deadline = [], time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        got += source.poll(timeout=0.5)
    got += source.poll(timeout=1.0)  # anything beyond n (duplicates, stray traces) shows up too
    return got


def make_engine(target, tee: TeeSink) -> TorchEngine:
    recorder = TraceRecorder(tee, target.fingerprint)
    return TorchEngine(target, build_drafter("suffix", target),
                       EngineConfig(k=4, max_batch_size=4), observers=[recorder])


class Client:
    """Sends requests and keeps what each one received, as an HTTP client would."""

    def __init__(self, engine: TorchEngine):
        self.engine = engine
        self.received: dict[str, list[int]] = {}
        self.finish: dict[str, str | None] = {}
        self.failed: dict[str, BaseException] = {}

    async def one(self, prompt: list[int], *, train: bool = True, max_tokens: int = 24,
                  temperature: float = 0.0, seed: int | None = None) -> str:
        rid = f"req-{uuid.uuid4().hex[:12]}"
        request = GenerationRequest(
            request_id=rid, prompt_ids=prompt, tenant=("acme", "globex")[len(self.received) % 2],
            domain="chat", train=train,
            params=SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed),
        )
        tokens: list[int] = []
        self.received[rid] = tokens
        try:
            async for chunk in self.engine.generate(request):
                tokens.extend(chunk.token_ids)
                if chunk.finished:
                    self.finish[rid] = chunk.finish_reason
        except Exception as e:  # noqa: BLE001 - counted, asserted to be none
            self.failed[rid] = e
        return rid

    async def many(self, prompts: list[list[int]], **kw) -> list[str]:
        return list(await asyncio.gather(*(self.one(p, **kw) for p in prompts)))


def test_engine_traces_reach_the_trainer_intact(kafka_broker, kafka_topic, target, prompts):
    tee = TeeSink(fast_sink(kafka_broker.url, kafka_topic))
    engine = make_engine(target, tee)
    client = Client(engine)

    async def serve():
        train_ids = await client.many(prompts * 2)  # 12 requests, 4 at a time
        sampled = await client.one(prompts[1], temperature=0.8, seed=7, max_tokens=16)
        opted_out = await client.many(prompts[:3], train=False)
        await engine.stop()  # every on_request_finish has run once the step thread is gone
        return train_ids + [sampled], opted_out

    try:
        train_ids, opted_out = asyncio.run(serve())
        assert tee.sink.flush(15)
    finally:
        tee.close()
    sink = tee.sink
    assert not client.failed
    assert set(client.finish) == set(train_ids) | set(opted_out)
    assert set(tee.built) == set(train_ids) and tee.duplicates == 0  # train=False: no trace
    assert (sink.emitted, sink.sent, sink.shed) == (len(train_ids), len(train_ids), 0)
    drafted = sum(int(r.steps.num_drafted.sum()) for r in tee.built.values())
    assert drafted > 0  # the suffix drafter proposed: the draft arrays carry real data

    source = fresh_source(kafka_broker.url, kafka_topic)
    try:
        got = consume(source, len(train_ids))
        assert source.commit()
        assert source.dead_lettered == 0
    finally:
        source.close()
    ids = [r.request_id for r in got]
    assert sorted(ids) == sorted(train_ids)  # each finished train=True request exactly once
    for record in got:
        built = tee.built[record.request_id]
        assert_same_trace(built, record)
        assert record.output_ids.tolist() == client.received[record.request_id]
        assert record.finish_reason == client.finish[record.request_id]
        assert record.target == target.fingerprint and record.drafter_kind == "suffix"
        assert record.steps.target_topk_ids.shape[-1] == EngineConfig().trace_topk


@pytest.mark.usefixtures("requires_tansu")
def test_broker_killed_mid_run_serving_continues_and_export_resumes(private_stack, kafka_topic,
                                                                    target, prompts):
    broker = private_stack.start_broker()
    tee = TeeSink(fast_sink(broker.url, kafka_topic, queue_size=8, max_in_flight=16))
    engine = make_engine(target, tee)
    client = Client(engine)
    sink = tee.sink
    phases: dict[str, list[str]] = {}

    async def serve_until(phase: str, done, limit: int) -> None:
        """Keep 4 requests in flight until ``done()`` holds (or ``limit`` requests were served)."""
        ids = phases.setdefault(phase, [])
        i = 0
        while not done() and len(ids) < limit:
            ids += await client.many([prompts[(i + j) % len(prompts)] for j in range(4)])
            i += 4

    async def run():
        await serve_until("before", lambda: False, limit=4)
        deadline = time.monotonic() + 15
        while sink.sent < 4 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        sent_before = sink.sent

        # Kill the broker while requests are decoding.
        steps0 = engine.steps
        in_flight = asyncio.ensure_future(client.many(prompts[:4], max_tokens=48))
        while engine.steps < steps0 + 3 and not in_flight.done():
            await asyncio.sleep(0.005)
        assert not in_flight.done()
        await asyncio.to_thread(private_stack.stop, "broker")
        phases["during"] = await in_flight
        await serve_until("during", lambda: sink.shed > 0, limit=400)
        sent_during = sink.sent  # everything acknowledged so far died with the broker

        private_stack.start_broker(port=broker.port)  # memory storage: comes back empty
        await serve_until("after", lambda: sink.sent >= sent_during + 4
                          and len(phases.get("after", [])) >= 8, limit=400)
        await engine.stop()
        return sent_before, sent_during

    try:
        sent_before, sent_during = asyncio.run(run())
        assert sink.flush(15)
    finally:
        tee.close()

    served = [rid for ids in phases.values() for rid in ids]
    assert not client.failed  # 0 failed requests
    assert set(client.finish) == set(served)  # every request completed ...
    assert all(reason in ("length", "stop") for reason in client.finish.values())  # ... normally
    assert all(client.received[rid] for rid in served)
    assert set(tee.built) == set(served)  # and every one of them produced a trace
    assert sent_before == 4
    assert sink.shed > 0, sink.shed_by_reason
    assert sink.sent >= sent_during + 4, sink.shed_by_reason  # export resumed after the restart
    assert sink.emitted == sink.sent + sink.shed == len(served)

    exported_after_restart = sink.sent - sent_during
    source = fresh_source(broker.url, kafka_topic)
    try:
        got = consume(source, exported_after_restart)
    finally:
        source.close()
    # What the sink counted as sent since the restart is on the new broker, once each ...
    assert len(got) == len({r.request_id for r in got}) == exported_after_restart
    assert {r.request_id for r in got} <= set(served)
    # ... including traces of requests served after the restart.
    assert any(r.request_id in set(phases["after"]) for r in got)
    for record in got:
        assert_same_trace(tee.built[record.request_id], record)
        assert record.output_ids.tolist() == client.received[record.request_id]
