"""docker-compose.yml's topology, proven as processes on this machine (issue 14).

``infra.topology.Topology`` (what ``specloop up`` runs) starts the stack, two ``specloop serve``
replicas and ``specloop train``, each with the command and environment docker-compose.yml gives its
service (loopback addresses for service names, TorchEngine for SGLang, a tiny random model with the
real tokenizer for speed; EXTRA only shrinks batch sizes and training rounds). With the real
broker, Redis and MLflow it shows: a prompt family served only on replica A raises replica B's
acceptance on it (trace following); a load burst pauses training and training resumes after it;
traces from both replicas reach the trainer; a promoted drafter goes live on both replicas, and a
forced rollback on A reverts the trainer's champion; ``kill -9`` of the trainer is restarted and
resumes from its checkpoint; a 30 s broker outage fails no request; ``down`` leaves no process
behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest

from infra.processes import _group_members
from infra.topology import Topology

pytestmark = pytest.mark.integration

EXTRA = {
    "SPECLOOP_MAX_BATCH_SIZE": "2",  # a burst queues up
    "SPECLOOP_NUM_THREADS": "1",
    "SPECLOOP_HEARTBEAT_S": "0.2",
    "SPECLOOP_OPS_EVERY_S": "0.5",
    "SPECLOOP_TRAINER_MIN_TRAIN_TRACES": "2",
    "SPECLOOP_TRAINER_STEPS_PER_ROUND": "2",
    "SPECLOOP_TRAINER_ROUNDS_PER_GATE": "1",
    "SPECLOOP_TRAINER_MAX_QUEUE_DEPTH": "1",
    "SPECLOOP_TRAINER_POLL_TIMEOUT_S": "0.3",
    "SPECLOOP_TRAINER_NUM_CPUS": "1",
    # A tiny random target sampled at T=1 teaches no drafter anything worth promoting (expected
    # acceptance ~0.001): negative margins let every gate promote, so promotions, swaps and a
    # forced rollback can be watched across processes.
    "SPECLOOP_TRAINER_ACCEPTANCE_MARGIN": "-1",
    "SPECLOOP_TRAINER_SPEEDUP_MARGIN": "-0.5",
}
BURST = 40  # requests at once on replica A: 20x its batch size
FAMILY = "Write a limerick about a {} who repairs old lighthouses on the northern coast."
CONTROL = "List three facts about the orbit of {} and explain each in one sentence."


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from serving.target import tiny_target

    target = tiny_target(num_layers=4, seed=3)  # the real SmolLM2 tokenizer: text in, text out
    path = tmp_path_factory.mktemp("models") / "tiny-smollm"
    target.model.save_pretrained(path)
    target.tokenizer.save_pretrained(path)
    return path


def _model(url: str) -> str:
    return httpx.get(f"{url}/health", timeout=30).json()["model"]


def _chat(url: str, content: str, max_tokens: int = 24) -> dict:
    """Sampled with a fixed seed: the same output on every replica (sampling is keyed by seed and
    position), and no degenerate repetition of a random model for the suffix drafter to match."""
    r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "model": _model(url), "max_tokens": max_tokens, "temperature": 1.0, "seed": 7,
        "messages": [{"role": "user", "content": content}]})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["spec"]


def _metric(url: str, prefix: str) -> float:
    """Sum of the Prometheus samples at ``url``/metrics whose line starts with ``prefix``."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(prefix))


def _followed(url: str) -> float:
    return _metric(url, 'specloop_traces_followed_total{result="indexed"}')


def _trainer_runs(mlflow_uri: str, model_dir) -> list:
    """The trainer's MLflow ops runs, newest first (one per start of the trainer)."""
    from mlflow.tracking import MlflowClient

    from feedback.target.location import model_fingerprint

    client = MlflowClient(tracking_uri=mlflow_uri)
    exp = client.get_experiment_by_name(f"specloop/{model_fingerprint(str(model_dir))[1].key()}")
    if exp is None:
        return []
    runs = [r for r in client.search_runs([exp.experiment_id]) if r.data.tags.get("role") == "trainer"]
    return sorted(runs, key=lambda r: r.info.start_time, reverse=True)


def _child_of(pid: int) -> int | None:
    """The (first) live child process of ``pid``."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                return int(entry)
    return None


def _trainer_metrics(mlflow_uri: str, model_dir) -> dict[str, float]:
    """The newest trainer run's latest metrics."""
    runs = _trainer_runs(mlflow_uri, model_dir)
    return dict(runs[0].data.metrics) if runs else {}


def _wait(what: str, predicate, timeout_s: float = 120.0, every_s: float = 0.5, act=None, show=None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if act is not None:
            act()
        time.sleep(every_s)
    raise AssertionError(f"gave up waiting for {what}" + (f": {show()}" if show else ""))


def _settled(read, quiet_s: float = 2.0, timeout_s: float = 60.0) -> float:
    """``read()`` once it has not changed for ``quiet_s`` (records still in flight have landed)."""
    deadline = time.monotonic() + timeout_s
    value, since = read(), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.25)
        now = read()
        if now != value:
            value, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return value
    raise AssertionError(f"the count never settled (last {value})")


def test_compose_topology_runs_as_processes(tiny_model_dir, tmp_path):
    topo = Topology(tmp_path / "run", replicas=2, model=str(tiny_model_dir), drafter="suffix", extra_env=EXTRA)
    groups: list[int] = []
    try:
        info = topo.up()
        groups = [s.pid for s in topo.stack.info().services.values()]
        assert set(topo.stack.status()) == {"broker", "redis", "mlflow", "serving-0", "serving-1", "trainer"}
        assert all(topo.stack.status().values())
        a, b = info.replicas
        for url in (a, b):
            health = httpx.get(f"{url}/health", timeout=30).json()
            assert health["status"] == "ok" and health["drafter"]["kind"] == "suffix"
        sent = {"a": 0, "b": 0}

        def on_a(content: str, max_tokens: int = 24) -> dict:
            sent["a"] += 1
            return _chat(a, content, max_tokens)

        def on_b(content: str, max_tokens: int = 24) -> dict:
            sent["b"] += 1
            return _chat(b, content, max_tokens)

        # Replica B follows the trace topic from its latest offset: wait until it indexes A's traces.
        warm = iter(range(1000))
        _wait("replica B to index a trace served by A", lambda: _followed(b) > 0, every_s=1.0,
              act=lambda: on_a(f"Say hello to visitor number {next(warm)}.", 8))

        # A prompt family served only on A raises B's acceptance on it. The count is read before the
        # family is sent, once the warm-up's traces stopped arriving: read after it, B may already
        # have indexed the family (a fast broker did), and the wait would never see the count move.
        before = _settled(lambda: _followed(b))
        on_a(FAMILY.format("retired sailor"), 48)
        _wait("B to index the family", lambda: _followed(b) > before, act=lambda: None)
        family = on_b(FAMILY.format("retired sailor"), 48)
        control = on_b(CONTROL.format("Neptune"), 48)
        assert family["acceptance_rate"] > control["acceptance_rate"] + 0.2, (family, control)
        assert family["mean_accept_len"] > control["mean_accept_len"]

        # The trainer is consuming (its group joined): every trace so far reached it.
        mlflow = info.stack.mlflow_uri
        more = iter(range(1000))

        def polled_all():
            """Every trace sent so far, and every nudge but the newest: the wait sends a request
            now and then so the trainer trains (and logs its count) again, and the newest nudge's
            trace may still be on its way when the count is read."""
            due = sent["a"] + sent["b"]

            def caught_up() -> bool:
                nudges = sent["a"] + sent["b"] - due
                polled = _trainer_metrics(mlflow, tiny_model_dir).get("records_polled", 0)
                return polled >= due + max(0, nudges - 1)

            return caught_up

        _wait("the trainer to poll every trace", polled_all(), every_s=3.0,  # a trained round logs the count
              act=lambda: on_b(f"Count the masts of ship {next(more)}.", 8),
              show=lambda: (sent, _trainer_metrics(mlflow, tiny_model_dir)))

        # A load burst pauses training; it resumes once serving has spare capacity again.
        async def burst() -> None:
            model = _model(a)
            async with httpx.AsyncClient(timeout=300) as client:
                await asyncio.gather(*[client.post(f"{a}/v1/chat/completions", json={
                    "model": model, "max_tokens": 48, "temperature": 0,
                    "messages": [{"role": "user", "content": f"Describe harbour number {i} in detail."}]})
                    for i in range(BURST)])

        def burst_again() -> None:
            asyncio.run(burst())
            sent["a"] += BURST

        # The trainer sees a burst only while it is training or between rounds: one that came and
        # went while it scored a gate (on CI's two loaded cores, longer than the burst) is sent again.
        burst_again()
        _wait("the trainer to pause during a burst",
              lambda: _trainer_metrics(mlflow, tiny_model_dir).get("event.paused", 0) >= 1, timeout_s=180,
              every_s=5.0, act=burst_again, show=lambda: _trainer_metrics(mlflow, tiny_model_dir))
        tail = iter(range(1000))
        _wait("the trainer to resume after the burst",
              lambda: _trainer_metrics(mlflow, tiny_model_dir).get("event.resumed", 0) >= 1, every_s=2.0,
              act=lambda: on_b(f"Name a colour for boat {next(tail)}.", 8))

        # Traces from both replicas reached the trainer (one per request; dedup by request id).
        _wait("the trainer to poll every trace after the burst", polled_all(), every_s=3.0,
              act=lambda: on_b(f"Count the masts of ship {next(more)}.", 8),
              show=lambda: (sent, _trainer_metrics(mlflow, tiny_model_dir)))
        assert sent["a"] > 0 and sent["b"] > 0

        # A promoted drafter goes live on both replicas; a forced rollback on A reverts the
        # trainer's champion to the version A went back to: an earlier promotion the trainer
        # still holds, or, after the first, the day-0 drafter (no champion: the next gate judges
        # against nothing). A second promotion is not waited for: the tiny random target teaches
        # nothing, so each round's best-on-held-out weights are mostly the champion's own, and the
        # gate refuses to swap those (tests/trainer/test_rollback_follow.py covers the revert to a
        # held version).
        admin = {"Authorization": f"Bearer {topo.admin_token()}"}

        def drafter(url: str) -> dict:
            return httpx.get(f"{url}/admin/drafter", headers=admin, timeout=30).json()

        def same_promoted_version_on_both() -> dict | None:
            da, db = drafter(a), drafter(b)
            ok = da["version"] == db["version"] and da["kind"] == "hybrid" and str(da["version"]).isdigit()
            return da if ok else None

        _wait("a promoted drafter live on both replicas", same_promoted_version_on_both, every_s=2.0,
              timeout_s=240, act=lambda: on_b(f"Name a star over cape {next(more)}.", 8),
              show=lambda: (drafter(a), drafter(b), _trainer_metrics(mlflow, tiny_model_dir)))
        r = httpx.post(f"{a}/admin/drafter/rollback", headers=admin, timeout=60)
        assert r.status_code == 200, r.text
        rolled = r.json()
        assert drafter(a)["version"] == rolled["to_version"] and rolled["from_version"].isdigit()
        champion_after = rolled["to_version"] if rolled["to_version"].isdigit() else "none"
        assert champion_after != "none" or rolled["to_version"] == "day0", rolled

        def trainer_followed() -> dict | None:
            runs = _trainer_runs(mlflow, tiny_model_dir)
            last = json.loads(runs[0].data.tags.get("last_rollback", "{}")) if runs else {}
            return last if last.get("from_version") == rolled["from_version"] else None

        followed = _wait("the trainer to follow the rollback", trainer_followed, every_s=2.0, timeout_s=90,
                         act=lambda: on_b(f"Name a reef near cape {next(more)}.", 8))
        assert followed["to_version"] == rolled["to_version"] and followed["reason"].endswith("admin")
        assert followed["champion"] == champion_after  # the trainer's champion reverted

        # kill -9 of the trainer: compose's restart policy (specloop restart-policy) starts it again,
        # and it resumes from its checkpoint: its first round continues the step count the
        # checkpoint held (at most the one round in flight at the kill is trained again).
        supervisor = topo.stack.service("trainer").pid
        killed = _child_of(supervisor)
        steps_before = _trainer_metrics(mlflow, tiny_model_dir)["train_steps"]
        n_runs = len(_trainer_runs(mlflow, tiny_model_dir))
        os.kill(killed, signal.SIGKILL)
        _wait("the trainer to be started again", lambda: _child_of(supervisor) not in (None, killed), timeout_s=60)

        def restarted_and_trained() -> bool:
            runs = _trainer_runs(mlflow, tiny_model_dir)
            return len(runs) > n_runs and "train_steps" in runs[0].data.metrics

        _wait("the restarted trainer to train on new traces", restarted_and_trained, every_s=3.0,
              act=lambda: on_b(f"Name the tide table of bay {next(more)}.", 8))
        from mlflow.tracking import MlflowClient

        new_run = _trainer_runs(mlflow, tiny_model_dir)[0]
        history = MlflowClient(tracking_uri=mlflow).get_metric_history(new_run.info.run_id, "train_steps")
        first = min(history, key=lambda m: (m.step, m.timestamp)).value
        assert first >= steps_before - 2, (first, steps_before)  # 2 = SPECLOOP_TRAINER_STEPS_PER_ROUND

        # The broker stopped for 30 s under load: no request fails, traces are shed and counted,
        # and export resumes once it is back (the trainer polls new traces again).
        port = topo.stack.service("broker").port
        shed = _metric(a, "specloop_traces_shed_total")
        polled = _trainer_metrics(mlflow, tiny_model_dir).get("records_polled", 0)
        topo.stack.stop("broker")
        outage_end, n = time.monotonic() + 30, 0
        while time.monotonic() < outage_end:
            on_a(f"Name the lighthouse keeper number {n}.", 16)  # asserts 200
            n += 1
        assert n >= 5 and _metric(a, "specloop_traces_shed_total") > shed
        topo.stack.start_broker(port=port)  # tansu in memory: it comes back empty
        _wait("traces to reach the trainer after the outage",
              lambda: _trainer_metrics(mlflow, tiny_model_dir).get("records_polled", 0) > polled, every_s=3.0,
              act=lambda: on_a(f"Count the gulls of pier {next(more)}.", 8),
              show=lambda: (polled, _trainer_metrics(mlflow, tiny_model_dir)))
    finally:
        if not groups:
            groups = [s.pid for s in topo.stack.info().services.values()]
        members = {pid for g in groups for pid in _group_members(g)}
        stopped = topo.down()
    assert {"serving-0", "serving-1", "trainer", "broker", "redis", "mlflow"} <= set(stopped)
    alive = [pid for pid in members if os.path.exists(f"/proc/{pid}") and _group_members_of(pid)]
    assert not alive, f"processes left behind: {alive}"


def _group_members_of(pid: int) -> bool:
    """Still a live (non-zombie) process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
