"""bench interference's A/B rounds: the trainer process runs only in the 'beside' phases."""

import asyncio
import multiprocessing as mp
import time

import pytest

from benchmarks.bench_interference import _rounds, run


def _count_forever(steps) -> None:
    while True:
        time.sleep(0.001)
        with steps.get_lock():
            steps.value += 1


class _Chunk:
    def __init__(self, ids):
        self.token_ids = ids


class _FakeEngine:
    """Serves 4 tokens per request, 20 ms each."""

    def __init__(self, target, drafter, config):
        pass

    async def start(self):
        pass

    async def stop(self):
        pass

    async def generate(self, req):
        for _ in range(4):
            await asyncio.sleep(0.02)
            yield _Chunk([1])


def test_the_trainer_steps_only_while_serving_beside_it():
    ctx = mp.get_context("spawn")
    steps = ctx.Value("l", 0)
    proc = ctx.Process(target=_count_forever, args=(steps,), daemon=True)
    proc.start()
    try:
        time.sleep(0.5)
        out = asyncio.run(_rounds(None, [[1, 2]] * 3, 4, 2, proc.pid, steps, None, _FakeEngine))
        stopped_at = steps.value
        deadline = time.monotonic() + 10.0  # a loaded machine may take a while to schedule it
        while steps.value <= stopped_at and time.monotonic() < deadline:
            time.sleep(0.05)
        assert steps.value > stopped_at  # resumed once the bench is done
    finally:
        proc.terminate()
        proc.join(5)
    assert len(out["round_ratios"]) == 2 and out["rounds"] == 2
    assert out["trainer_steps_per_s"] > 10  # it ran beside serving...
    assert abs(out["serving_slowdown"]) < 0.5  # ...and the fake engine does not care


def test_an_unknown_training_precision_is_refused_before_anything_starts():
    with pytest.raises(ValueError, match="precision must be one of auto, fp32, bf16"):
        run(None, 1, 1, 2, "standalone", 1, precision="fp16")


def test_the_training_benches_refuse_an_unknown_precision_on_the_command_line():
    from typer.testing import CliRunner

    from infra.cli import app

    for bench in ("train", "interference"):
        out = CliRunner().invoke(app, ["bench", bench, "--precision", "fp16", "--json"])
        assert out.exit_code == 2, (bench, out.output)
        assert "choose one of auto, fp32, bf16" in out.output



def test_both_arms_prefill_the_same_prompt_tokens():
    """Every round serves the same prompts again: with a prefix cache only the first arm (alone)
    prefilled them, and the other arms' faster prefills were read as the trainer costing less."""
    from benchmarks.bench_interference import serving_config
    from serving.engine.torch_engine import TorchEngine
    from serving.target import tiny_target

    target = tiny_target()
    prompts = [list(range(3 + i, 40 + i)) for i in range(3)]  # several blocks of 8 tokens each
    ctx = mp.get_context("spawn")
    steps = ctx.Value("l", 0)
    proc = ctx.Process(target=_count_forever, args=(steps,), daemon=True)
    proc.start()
    try:
        out = asyncio.run(_rounds(target, prompts, 4, 2, proc.pid, steps, serving_config(), TorchEngine))
    finally:
        proc.terminate()
        proc.join(5)
    assert out["cached_prompt_tokens"]["alone"] == out["cached_prompt_tokens"]["beside"]
