"""bench engine on a tiny model: every field the issue names, measured, and the fast path lossless."""

from benchmarks.bench_engine import run


def test_bench_engine_reports_bound_and_verify_costs():
    out = run(threads=1, context=32, reps=2, device=None, tiny=True, lossless_tokens=6)
    for key in ("bandwidth_gbs", "weight_bytes", "bound_ms", "step_ms", "step_ms_plain_thread", "bound_fraction",
                "startup_s"):
        assert out[key] > 0, key
    assert set(out["verify_cost"]) == {"2", "4", "8", "16", "32"}
    assert set(out["reference"]["verify_cost"]) == set(out["verify_cost"])
    assert set(out["verify_cost_tree"]) == {"8", "16"} and all(c > 0 for c in out["verify_cost_tree"].values())
    assert out["forward"] == "llama_forward"
    assert out["lossless"] is True
    # the fraction is computed unrounded; bound_ms and step_ms are reported to 0.01 ms, which on a
    # tiny model's sub-millisecond step moves their ratio by a few per cent
    slack = out["bound_fraction"] * (0.005 / out["bound_ms"] + 0.005 / out["step_ms"]) + 0.001
    assert abs(out["bound_fraction"] - out["bound_ms"] / out["step_ms"]) <= slack
    assert "model" in out["cpu"] and isinstance(out["cpu"]["flags"], list)
    # the bound uses the faster of the step's own weights and a fresh tensor: never flattered
    probes = [out["bandwidth_gbs_256mb_tensor"]] + [out["bandwidth_gbs_weights"] or 0.0]
    assert out["bandwidth_gbs"] == max(probes) > 0


def test_prefill_figures_measure_the_prefix_cache_against_full_prefills():
    from benchmarks.prefill import prefix_cache_figures
    from serving.target import tiny_target

    target = tiny_target(vocab_size=101, hidden_size=64, num_layers=2, seed=3)
    shared = [(5 * i + 1) % 101 for i in range(24)]
    prompts = [shared + [i, i + 1, i + 2] for i in range(6)] + [[7, 8, 9, 10]]
    figures = prefix_cache_figures(target, {"s": prompts})["s"]
    assert figures["prompts"] == 7 and figures["bit_identical"] is True
    assert figures["hit_fraction"] == round(5 * 24 / (6 * 26 + 3), 3)  # the 5 later prompts' 3 blocks
    assert figures["prefill_ms_cached"] > 0 and figures["prefill_ms_plain"] > 0
