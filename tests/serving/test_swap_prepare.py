"""Hot swaps whose drafter is prepared off the step thread (TorchEngine.swap_drafter with a
PreparableDrafter): requests that join or finish between the snapshot and the install stay
lossless, every request ends up in the new drafter's state exactly once, and a learned drafter's
prepared + caught-up state is its full history (it keeps drafting what the target accepts).

Tiny random Llama on token ids; the new drafter is a standalone copy of the whole target, so with
a correct draft state it proposes exactly the target's greedy tokens.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from feedback.drafters.standalone_lm import standalone_from_target
from serving.drafters.standalone import StandaloneDrafter
from serving.engine import drafter_swap
from serving.engine.base import GenerationRequest, SamplingParams
from serving.engine.config import EngineConfig
from serving.engine.reference import target_greedy_reference
from serving.engine.torch_engine import TorchEngine
from serving.observers import BaseObserver

LONG = [[1, 2, 3, 4, 5], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12]]
SHORT = [42, 42, 42]
LATE = [5, 17, 33, 2]
MAX = {"long0": 64, "long1": 64, "short": 32, "late": 40}


def _req(rid, prompt):
    params = SamplingParams(temperature=0.0, max_tokens=MAX[rid], ignore_eos=True)
    return GenerationRequest(request_id=rid, prompt_ids=list(prompt), params=params)


class GatedStandalone(StandaloneDrafter):
    """Standalone drafter whose preparation waits for the test's go-ahead, recording every call."""

    def __init__(self, model, gate: threading.Event, version: str = "new"):
        super().__init__(model, version=version)
        self.gate = gate
        self.entered = threading.Event()
        self.prepared: dict[str, int] = {}
        self.prepare_threads: set[str] = set()
        self.added: list[str] = []
        self.removed: dict[str, list[int] | None] = {}
        self.fed: dict[str, list[int]] = {}  # the tokens each request's draft state was given

    def prepare_request(self, view, features=None):
        self.prepare_threads.add(threading.current_thread().name)
        assert view.generator is None  # the row's RNG stays on the step thread
        self.entered.set()
        assert self.gate.wait(30)
        super().prepare_request(view, features)
        self.prepared[view.request_id] = len(view.token_ids)
        self.fed[view.request_id] = list(view.token_ids)

    def add_request(self, view, features=None):
        self.added.append(view.request_id)
        super().add_request(view, features)
        self.fed[view.request_id] = list(view.token_ids)

    def on_verified(self, request_id, accepted_ids, features):
        super().on_verified(request_id, accepted_ids, features)
        self.fed[request_id].extend(accepted_ids)

    def remove_request(self, request_id, output_ids):
        self.removed[request_id] = output_ids
        super().remove_request(request_id, output_ids)


class StepLog(BaseObserver):
    def __init__(self):
        self.steps = []  # (version, request ids, num_drafted, num_accepted)

    def on_step(self, batch):
        self.steps.append(
            (
                batch.drafter_version,
                list(batch.request_ids),
                batch.num_drafted.tolist(),
                batch.num_accepted.tolist(),
            )
        )


@pytest.mark.parametrize("rounds", [1, 3])
def test_requests_joining_and_finishing_during_preparation_stay_lossless(
    ids_target, drafters, monkeypatch, rounds
):
    """rounds=1: the late request joined after the only snapshot and is added at install;
    rounds=3: a second snapshot picks it up and it is prepared too."""
    monkeypatch.setattr(drafter_swap, "_PREPARE_ROUNDS", rounds)
    model = ids_target.model
    gate = threading.Event()
    new = GatedStandalone(standalone_from_target(model, num_layers=2), gate)

    class Old(drafters.Recording):
        """Proposes nothing (one token per step, predictable). Each step takes at least 3 ms, so
        the short request is still running when the swap's snapshot is taken (on a fast machine
        its tiny-model steps once all ran before it); once ``slow`` is set, 20 ms, so the others are
        still running when the preparation ends."""

        slow = threading.Event()

        def propose(self, views, k):
            time.sleep(0.02 if self.slow.is_set() else 0.003)
            return super().propose(views, k)

    old = Old(version="old")
    log = StepLog()
    engine = TorchEngine(ids_target, old, EngineConfig(k=3, max_batch_size=4), observers=[log])

    async def collect(req):
        chunks = []
        async for c in engine.generate(req):
            chunks.append(c)
        return [t for c in chunks for t in c.token_ids]

    async def until(cond, timeout=30.0):
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while not cond() and loop.time() < end:
            await asyncio.sleep(0.002)
        assert cond()

    def running(rid):
        return any(rid in ids for _, ids, _, _ in log.steps)

    async def main():
        await engine.start()
        try:
            tasks = {
                "long0": asyncio.ensure_future(collect(_req("long0", LONG[0]))),
                "long1": asyncio.ensure_future(collect(_req("long1", LONG[1]))),
                "short": asyncio.ensure_future(collect(_req("short", SHORT))),
            }
            await until(lambda: all(running(r) for r in tasks))
            swap = asyncio.ensure_future(asyncio.to_thread(engine.swap_drafter, new))
            await until(new.entered.is_set)  # snapshot taken, preparation under way and held
            out = {"short": await tasks["short"]}  # finishes before the install
            tasks["late"] = asyncio.ensure_future(collect(_req("late", LATE)))
            await until(lambda: running("late"))  # joins after the (first) snapshot
            assert engine.drafter is old and not new.prepared
            old.slow.set()
            gate.set()
            await swap
            for rid, t in tasks.items():
                if rid not in out:
                    out[rid] = await t
            return out
        finally:
            gate.set()
            await engine.stop()

    out = asyncio.run(main())
    prompts = {"long0": LONG[0], "long1": LONG[1], "short": SHORT, "late": LATE}
    for rid, prompt in prompts.items():
        assert out[rid] == target_greedy_reference(model, prompt, MAX[rid]), rid

    assert engine.drafter is new
    assert new.prepare_threads and all(
        n.startswith("specloop-swap-prepare") for n in new.prepare_threads
    )
    # prepared from the snapshot; the short one ended before the install and was dropped there
    assert {"long0", "long1", "short"} <= set(new.prepared)
    assert new.removed["short"] is None
    if rounds == 1:
        assert "late" not in new.prepared and new.added == ["late"]
    else:
        assert "late" in new.prepared and new.added == []
    assert not new._states  # every request left the new drafter
    for rid in ("long0", "long1", "late"):  # snapshot + catch-up = the whole history, in order
        assert new.removed[rid] == out[rid]
        assert new.fed[rid] == prompts[rid] + out[rid], rid

    # the steps under the new drafter ran every request that was in flight, and a prepared-then-
    # caught-up state is the full history: the target copy's drafts are (almost) all accepted
    after = [s for s in log.steps if s[0] == "new"]
    assert after and {"long0", "long1", "late"} <= {r for _, ids, _, _ in after for r in ids}
    drafted = sum(sum(d) for _, _, d, _ in after)
    accepted = sum(sum(a) for _, _, _, a in after)
    assert drafted > 0 and accepted >= 0.9 * drafted


class FeatureRecorder:
    """Preparable recording drafter that wants target features (like eagle)."""

    kind = "eagle"

    def __init__(self, base, layers):
        self.base = base
        self.feature_layers = layers
        self.version = base.version
        self.prepared = {}

    def prepare_request(self, view, features=None):
        self.prepared[view.request_id] = (list(view.token_ids), features)
        self.base.verified[view.request_id] = []

    def __getattr__(self, name):
        return getattr(self.base, name)


def test_prepared_features_and_caught_up_features_cover_the_history(ids_target, drafters):
    layers = (1, -1)
    model = ids_target.model
    class SlowRecording(drafters.Recording):
        """10 ms a step: the request is still running when the swap installs, even on a loaded
        machine (else it may finish first and the test's premise fails, not the engine)."""

        def propose(self, views, k):
            time.sleep(0.01)
            return super().propose(views, k)

    old = SlowRecording(version="old", feature_layers=layers)  # rows keep these features
    new = FeatureRecorder(drafters.Recording(version="new", feature_layers=layers), layers)
    engine = TorchEngine(ids_target, old, EngineConfig(k=2))
    prompt = LONG[1]

    async def main():
        await engine.start()
        got = []
        async for c in engine.generate(_req("long1", prompt)):
            got.append(c)
            if len(got) == 5:
                await asyncio.to_thread(engine.swap_drafter, new)
        await engine.stop()
        return [t for c in got for t in c.token_ids]

    out = asyncio.run(main())
    assert out == target_greedy_reference(model, prompt, MAX["long1"])
    history, feats = new.prepared["long1"]
    assert "long1" not in new.base.added  # prepared, not re-added
    steps = new.base.verified["long1"]
    tokens = history + [t for ids, _ in steps for t in ids]
    assert tokens == list(prompt) + out
    got = torch.cat([feats] + [f for _, f in steps])  # every input the target kept, in order
    with torch.inference_mode():
        full = model(torch.tensor([tokens[:-1]]), output_hidden_states=True)
    expected = torch.cat([full.hidden_states[i][0] for i in layers], dim=-1)
    assert got.shape == expected.shape
    torch.testing.assert_close(got.float(), expected.float(), atol=1e-4, rtol=1e-4)
