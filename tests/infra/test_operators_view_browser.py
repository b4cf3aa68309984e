"""The operators' view, seen as an operator sees it: MLflow's own UI in a real headless browser.

Serving's LiveOpsObserver logs a replica's figures into the stack's MLflow server (a chat domain that
stays healthy and a code domain whose acceptance collapses), then Chromium renders the run's page
and we read what it shows: the run, per-domain acceptance and tokens per verify, the drift event
and the drifting domain. (The closed-loop test in test_demo.py checks the same store over the API
after a real loop.)
"""

from __future__ import annotations

import shutil
import subprocess
from types import SimpleNamespace

import numpy as np
import pytest

pytestmark = pytest.mark.integration

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def _render(url: str) -> str:
    """The DOM after MLflow's single-page app rendered (Chromium's virtual time lets it finish)."""
    out = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=20000",
         "--dump-dom", url],
        capture_output=True, text=True, timeout=120, check=False,
    )
    return out.stdout


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (make install adds it)")
def test_mlflow_ui_shows_live_figures_and_the_drifting_domain(mlflow_server):
    from mlflow.tracking import MlflowClient
    from prometheus_client import CollectorRegistry

    from feedback.ops.ops_log import open_run
    from feedback.target.fingerprint import TargetFingerprint
    from serving.engine.base import GenerationRequest, SamplingParams
    from serving.ops_observer import DriftObserver, LiveOpsObserver

    fp = TargetFingerprint(model_id="browser-check", tokenizer_hash="t0", vocab_size=64)
    run = open_run(mlflow_server.url, fp, "serving", "acme", "r1", flush_s=0.1)
    from feedback.ops.drift import DriftDetector

    fast = DriftDetector(fast_steps=4, slow_steps=64, min_steps=8, persist_steps=3, cooldown_steps=0)
    drift = DriftObserver(fast, registry=CollectorRegistry())  # a drift within 80 steps, not thousands
    obs = LiveOpsObserver(run, every_s=0.0, drift=drift)
    observers = (drift, obs)  # as the engine has them: each hears every request and step
    obs.on_drafter_change("suffix", "day0")
    for rid, dom in (("a", "chat"), ("b", "code")):
        for o in observers:
            o.on_request_start(GenerationRequest(request_id=rid, prompt_ids=[1], params=SamplingParams(),
                                                 domain=dom))

    def step(code_accepted: int) -> None:
        for o in observers:
            o.on_step(SimpleNamespace(
                request_ids=["a", "b"], num_drafted=np.array([4, 4]), num_accepted=np.array([2, code_accepted]),
                emitted=[[7] * 3, [7] * (code_accepted + 1)], draft_ms=1.0, verify_ms=60.0))

    for _ in range(60):
        step(3)
    for _ in range(20):
        step(0)  # code acceptance collapses
    obs.flush()
    run.close()
    assert [e.domain for e in obs.drifts] == ["code"]

    client = MlflowClient(tracking_uri=mlflow_server.url)
    exp = client.get_experiment_by_name(f"specloop/{fp.key()}")
    run_id = client.search_runs([exp.experiment_id])[0].info.run_id
    page = _render(f"{mlflow_server.url}/#/experiments/{exp.experiment_id}/runs/{run_id}")
    for shown in ("serving-acme-r1", "acceptance.chat", "acceptance.code", "tokens_per_verify.code",
                  "spec_off_fraction", "event.drift", "drift.code"):
        assert shown in page, f"{shown!r} not shown in the MLflow UI"
    assert "drift.chat" not in page  # only the domain that drifted
