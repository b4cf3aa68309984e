"""Serving heartbeats its load to Redis; the trainer's ServingLoad reads it: saturated while requests
queue beyond the threshold, not saturated once they drained (issue 14: the wire was one-sided)."""

from __future__ import annotations

import asyncio
import time

import pytest

from feedback.control.plane import ControlPlane, ControlSettings
from serving.engine.base import GenerationRequest, SamplingParams
from serving.engine.config import EngineConfig
from serving.engine.torch_engine import TorchEngine
from serving.load_report import LoadReporter
from serving.target import tiny_target
from trainer.control import ServingLoad

pytestmark = pytest.mark.integration


def test_heartbeats_pause_training_under_load_and_resume_after(redis_server, redis_namespace):
    control = ControlPlane(ControlSettings(url=redis_server.url, namespace=redis_namespace))
    target = tiny_target(vocab_size=64, hidden_size=64, num_layers=2)
    engine = TorchEngine(target, None, EngineConfig(k=0, max_batch_size=1))
    reporter = LoadReporter(engine, control, "replica-a", every_s=0.1)
    saturated = ServingLoad(control, max_queue_depth=2, cache_s=0.0)
    seen: list[tuple[bool, int]] = []

    async def main():
        await engine.start()
        reporter.start()
        try:
            assert not saturated()  # idle replica
            reqs = [GenerationRequest(request_id=f"r{i}", prompt_ids=[1, 2, 3],
                                      params=SamplingParams(max_tokens=120)) for i in range(16)]

            async def drain(req):
                async for _ in engine.generate(req):
                    pass

            tasks = [asyncio.create_task(drain(r)) for r in reqs]
            t0 = time.monotonic()
            while not all(t.done() for t in tasks) and time.monotonic() - t0 < 60:
                await asyncio.sleep(0.05)
                beats = control.loads()
                if beats:
                    seen.append((saturated(), beats[0].queue_depth))
            await asyncio.gather(*tasks)
            await asyncio.sleep(0.35)  # a beat after the burst
            return saturated(), control.loads()
        finally:
            reporter.stop()
            await engine.stop()

    after, beats = asyncio.run(main())
    assert any(sat and depth > 2 for sat, depth in seen), seen  # the burst paused training
    assert not after  # and training resumes once the queue drained
    assert beats and beats[0].replica_id == "replica-a" and beats[0].queue_depth == 0
    assert reporter.beats >= 3
