"""bench capture's direct measure of what the trace path costs: the step thread's time in it and
the export threads' CPU, measured in the capture arm's own runs."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from benchmarks.bench_capture import _one_run, thread_cpu_s


def test_thread_cpu_counts_the_named_threads_only():
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            pass

    busy = threading.Thread(target=spin, name="probe-network-thread", daemon=True)
    idle = threading.Thread(target=stop.wait, name="probe-idle", daemon=True)
    before = thread_cpu_s(("probe-network-thread",))
    busy.start()
    idle.start()
    time.sleep(0.4)
    during = thread_cpu_s(("probe-network-thread",))
    idle_cpu = thread_cpu_s(("probe-idle",))
    stop.set()
    busy.join()
    idle.join()
    assert before == 0.0 and during >= 0.1
    assert idle_cpu < 0.05


@pytest.mark.usefixtures("kafka_broker")
def test_the_capture_arm_measures_its_trace_path(kafka_broker, kafka_topic):
    from feedback.bus.kafka_sink import KafkaTraceSink
    from serving.target import tiny_target

    target = tiny_target()
    prompts = [list(range(100, 120)), list(range(300, 330))]
    sink = KafkaTraceSink(bootstrap_servers=kafka_broker.url, topic=kafka_topic)
    try:
        def run(arm):
            return asyncio.run(_one_run(target, sink, arm, prompts, ["chat", "code"], max_tokens=12,
                                        k=4, concurrency=2, features=False))

        res, cost = run("capture")
        assert res.tokens > 0 and res.failed == 0
        assert sink.sent == 2  # the run's traces were exported before its cost was read
        assert 0.0 < cost["step_thread_pct"] < 100.0
        assert cost["export_cpu_pct"] >= 0.0
        base, none_cost = run("none")
        assert none_cost == {} and base.outputs == res.outputs
    finally:
        sink.close()


def test_the_overhead_interval_brackets_the_pairs_and_says_when_noise_hides_it():
    from benchmarks.bench_capture import overhead_figures
    from benchmarks.runner import RunResult

    def runs(tok_s_list):
        return [RunResult(tokens=1000, wall_s=1000 / t) for t in tok_s_list]

    # capture 5 % slower in every pair: the interval is tight around 5
    steady = overhead_figures(runs([100, 80, 120, 90]), runs([95, 76, 114, 85.5]))
    low, high = steady["overhead_pct_ci95"]
    assert steady["overhead_pct"] == 5.0 and 4.9 <= low <= 5.0 <= high <= 5.1
    # pairs at -15 / +13 %: the median reads a figure, the interval spans zero
    noisy = overhead_figures(runs([100, 100, 100, 100]), runs([115, 87, 113, 89]))
    low, high = noisy["overhead_pct_ci95"]
    assert low < 0.0 < high
    assert noisy["overhead_pct_pairs"] == [-15.0, 13.0, -13.0, 11.0]
    assert overhead_figures(runs([100]), runs([90]))["overhead_pct_ci95"] is None
