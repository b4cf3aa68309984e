"""The trainer sees a shift of its traffic to a domain it has trained little on, and focuses
training there as it does on a drift serving reports (trainer/traffic_shift.py)."""

from __future__ import annotations

from trainer_tracegen import FP, make_trace, tiny_lm

from feedback.ops.ops_log import OpsRun
from trainer.distill import DistillConfig
from trainer.gate import GateConfig
from trainer.loop import LoopConfig, TrainerLoop
from trainer.replay import ReplayBuffer
from trainer.sources import ListTraceSource
from trainer.students import StandaloneStudent
from trainer.traffic_shift import TrafficShift


def _replay(domains) -> ReplayBuffer:
    rb = ReplayBuffer(heldout_fraction=0.0, fingerprint=FP)
    for i, d in enumerate(domains):
        rb.add(make_trace(d, seed=i, out_len=8), heldout=False)
    return rb


def _first_shift(domains, **kw) -> tuple[int | None, dict]:
    """Feed arrivals one at a time: (index of the arrival that made a shift, what shifted)."""
    shift, rb = TrafficShift(**kw), ReplayBuffer(heldout_fraction=0.0, fingerprint=FP)
    for i, d in enumerate(domains):
        rb.add(make_trace(d, seed=i, out_len=8), heldout=False)
        shift.observe([d])
        got = shift.shifted(rb.domain_shares())
        if got:
            return i, got
    return None, {}


def test_a_new_domain_is_a_shift_once_it_is_a_quarter_of_the_window():
    at, got = _first_shift(["chat"] * 40 + ["code"] * 20)
    assert at == 40 + 3  # the 4th code arrival: 4 of the latest 16, 4 of 44 traces in training
    assert set(got) == {"code"}
    now, trained = got["code"]
    assert now == 0.25 and trained < 0.125


def test_steady_mixes_unlabelled_traffic_and_a_short_history_are_no_shift():
    assert _first_shift(["chat", "code", "chat", "math"] * 20)[0] is None  # the mix training has
    assert _first_shift([None] * 60)[0] is None  # no domain labels: one domain, never new
    assert _first_shift(["code"] * 5 + ["chat"] * 10)[0] is None  # the window (16) is not full yet


def test_a_domain_training_already_samples_is_not_a_shift_however_recent():
    # code was half of training before a stretch of chat: its return is not new to training
    assert _first_shift(["code", "chat"] * 20 + ["chat"] * 6 + ["code"] * 10)[0] is None
    # a replay whose half-life is short already samples what just arrived: nothing to correct
    shift = TrafficShift()
    rb = ReplayBuffer(heldout_fraction=0.0, fingerprint=FP, half_life=4.0)
    doms = ["chat"] * 40 + ["code"] * 4
    for i, d in enumerate(doms):
        rb.add(make_trace(d, seed=i, out_len=8), heldout=False)
    shift.observe(doms)
    assert rb.domain_shares()["code"] > 0.5 and shift.shifted(rb.domain_shares()) == {}


def test_replay_domain_shares_follow_recency_and_ignore_focus():
    rb = _replay(["a"] * 10 + ["b"] * 10)
    even = rb.domain_shares()
    assert abs(sum(even.values()) - 1.0) < 1e-9 and even["b"] > even["a"]  # b is the more recent
    rb.focus = {"a": 4.0}
    assert rb.domain_shares() == even  # what training samples without the boost


def _loop(traces, tmp_path=None, **kw):
    ops = OpsRun(f"sqlite:///{tmp_path}/m.db", "specloop/x", "trainer-acme", flush_s=3600) if tmp_path else None
    loop = TrainerLoop(ListTraceSource(traces), StandaloneStudent(tiny_lm(seed=0)), FP,
                       loop=LoopConfig(tenant="acme", poll_records=6, min_train_traces=4, steps_per_round=2,
                                       rounds_per_gate=1000, drift_boost=4.0, drift_rounds=3, **kw),
                       distill=DistillConfig(lr=3e-3, eval_every=100), gate=GateConfig(k=3, hybrid=False),
                       ops=ops)
    return loop, ops


def test_the_loop_focuses_training_on_the_domain_the_traffic_moved_to_and_gates_early(tmp_path):
    traces = [make_trace("a", seed=i, tenant="acme") for i in range(30)]
    traces += [make_trace("b", seed=100 + i, tenant="acme") for i in range(12)]
    traces += [make_trace("a", seed=200 + i, tenant="acme") for i in range(30)]
    loop, ops = _loop(traces, tmp_path)
    for _ in range(5):  # 30 traces of a: no shift, no gate (every 1000 rounds)
        loop.run_round()
    assert loop.stats.traffic_shifts == 0 and loop.replay.focus == {} and loop.stats.last_decision == ""
    loop.run_round()  # 6 traces of b: 6 of the latest 16 arrivals, none of training
    assert loop.stats.traffic_shifts == 1
    assert loop.replay.focus == {"b": 4.0}
    assert loop.stats.last_decision != ""  # that round ended with a gate
    loop.run_round()  # still shifted, already focused: the focus goes on, not a new shift
    assert loop.stats.traffic_shifts == 1 and loop.replay.focus == {"b": 4.0}
    for _ in range(5):  # the traffic is back on a: the focus ends drift_rounds rounds later
        loop.run_round()
    assert loop.replay.focus == {} and loop.stats.traffic_shifts == 1
    ops.flush()
    tags = ops.client.get_run(ops.run_id).data.tags
    assert '"domain": "b"' in tags["last_traffic_shift"]
    ops.close()


def test_traffic_window_none_leaves_focus_to_serving_drifts():
    traces = [make_trace("a", seed=i, tenant="acme") for i in range(30)]
    traces += [make_trace("b", seed=100 + i, tenant="acme") for i in range(12)]
    loop, _ = _loop(traces, traffic_window=None)
    for _ in range(7):
        loop.run_round()
    assert loop.stats.traffic_shifts == 0 and loop.replay.focus == {}
