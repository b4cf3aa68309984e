"""``specloop bench load``: overload on loopback, and what admission control makes of it.

A server (uvicorn + TorchEngine, tiny random model by default) runs in a child process. First its
capacity is measured closed-loop (``max_batch_size`` clients back to back), then requests arrive
open-loop at ``factor`` x that rate for ``duration_s``. Reported: status counts (200 / 429 / other
/ transport errors), how many admitted requests finished complete, latency of the admitted ones,
and the server's peak RSS against its RSS before the overload (memory stays bounded when the queue
is). Client and server share this machine's cores: the client's own CPU use is part of the load.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time

import typer

from benchmarks.output import json_option, print_json
from kernels.cpu import cpu_model


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _serve(port: int, tiny: bool, max_batch_size: int, max_waiting: int, k: int, threads: int) -> None:
    """Child process: the server."""
    import logging

    import uvicorn

    from infra.root import load_settings
    from serving.api.app import create_app
    from serving.builder import build_engine
    from serving.target import tiny_target

    logging.basicConfig(level=logging.WARNING)
    settings = load_settings(serving={"served_model_name": "load", "drafter": "suffix", "k": k,
                                      "num_threads": threads, "max_batch_size": max_batch_size,
                                      "max_waiting": None if max_waiting < 0 else max_waiting}).serving
    target = tiny_target(hidden_size=256, num_layers=4) if tiny else None
    engine = build_engine(settings, target=target)
    uvicorn.run(create_app(engine, settings), host="127.0.0.1", port=port, log_level="error",
                backlog=4096, timeout_keep_alive=30)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _one(client, body: dict, out: dict, max_tokens: int) -> None:
    t0 = time.perf_counter()
    try:
        r = await client.post("/v1/completions", json=body)
    except Exception as e:  # noqa: BLE001 - every failure is a figure here
        out["transport_errors"][type(e).__name__] = out["transport_errors"].get(type(e).__name__, 0) + 1
        return
    dt = time.perf_counter() - t0
    out["status"][r.status_code] = out["status"].get(r.status_code, 0) + 1
    if r.status_code == 200:
        out["latency_s"].append(dt)
        if r.json()["usage"]["completion_tokens"] == max_tokens:
            out["complete"] += 1
    elif r.status_code == 429 and (not r.headers.get("retry-after")
                                   or r.json()["error"]["code"] != "rate_limit_exceeded"):
        out["bad_429"] += 1


def _new() -> dict:
    return {"status": {}, "transport_errors": {}, "latency_s": [], "complete": 0, "bad_429": 0}


async def _closed_loop(base: str, clients: int, seconds: float, body: dict, max_tokens: int) -> float:
    import httpx

    out, end = _new(), time.monotonic() + seconds
    async with httpx.AsyncClient(base_url=base, timeout=300) as client:
        async def worker():
            while time.monotonic() < end:
                await _one(client, body, out, max_tokens)

        t0 = time.monotonic()
        await asyncio.gather(*[worker() for _ in range(clients)])
        return out["complete"] / (time.monotonic() - t0)


async def _open_loop(base: str, rate: float, seconds: float, body: dict, max_tokens: int,
                     pid: int) -> dict:
    import httpx

    out, rss = _new(), []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=base, timeout=300, limits=limits) as client:
        tasks, t0, n = [], time.monotonic(), 0
        next_rss = t0
        while (now := time.monotonic()) < t0 + seconds:
            due = int((now - t0) * rate) + 1
            while n < due:
                tasks.append(asyncio.ensure_future(_one(client, body, out, max_tokens)))
                n += 1
            if now >= next_rss:
                rss.append(_rss_mb(pid))
                next_rss = now + 0.5
            await asyncio.sleep(0.002)
        sent_s = time.monotonic() - t0
        while not all(t.done() for t in tasks):
            rss.append(_rss_mb(pid))
            await asyncio.sleep(0.5)
    lat = sorted(out["latency_s"])
    return {"sent": n, "send_s": round(sent_s, 1), "status": out["status"],
            "transport_errors": out["transport_errors"], "admitted_complete": out["complete"],
            "malformed_429": out["bad_429"],
            "latency_admitted_s": {"p50": round(statistics.median(lat), 3) if lat else None,
                                   "p99": round(lat[int(0.99 * (len(lat) - 1))], 3) if lat else None,
                                   "max": round(lat[-1], 3) if lat else None},
            "server_rss_mb": {"peak": round(max(rss), 1), "samples": len(rss)}}


def run(tiny: bool, duration_s: float, factor: float, max_tokens: int, max_batch_size: int,
        max_waiting: int, k: int, threads: int, calibrate_s: float) -> dict:
    import httpx

    port = _free_port()
    proc = mp.get_context("spawn").Process(
        target=_serve, args=(port, tiny, max_batch_size, max_waiting, k, threads), daemon=True)
    proc.start()
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or not proc.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.2)
        body = {"model": "load", "prompt": "Write a short story about a lighthouse keeper.",
                "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0}  # greedy, as measured before
        asyncio.run(_closed_loop(base, max_batch_size, 2.0, body, max_tokens))  # warm-up
        rss_before = _rss_mb(proc.pid)
        capacity = asyncio.run(_closed_loop(base, max_batch_size, calibrate_s, body, max_tokens))
        rate = factor * capacity
        load = asyncio.run(_open_loop(base, rate, duration_s, body, max_tokens, proc.pid))
        other = sum(v for s, v in load["status"].items() if s not in (200, 429))
        return {
            "bench": "load", "cpu": cpu_model(), "cores": os.cpu_count(), "python": sys.version.split()[0],
            "model": "tiny random Llama (hidden 256, 4 layers)" if tiny else "SmolLM2-135M-Instruct",
            "max_batch_size": max_batch_size, "max_waiting": max_waiting, "k": k,
            "max_tokens": max_tokens, "capacity_rps": round(capacity, 2), "factor": factor,
            "offered_rps": round(rate, 2), "duration_s": duration_s,
            "server_rss_mb_before": round(rss_before, 1), **load,
            "ok_200": load["status"].get(200, 0), "refused_429": load["status"].get(429, 0),
            "other_errors": other + sum(load["transport_errors"].values()),
            "admitted_all_complete": load["admitted_complete"] == load["status"].get(200, 0),
        }
    finally:
        proc.terminate()
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def bench_load(
    tiny: bool = typer.Option(True, "--tiny/--real", help="Tiny random model (default) or SmolLM2."),
    duration: float = typer.Option(60.0, min=1, help="Seconds of overload."),
    factor: float = typer.Option(4.0, min=0.1, help="Offered load as a multiple of measured capacity."),
    max_tokens: int = typer.Option(32, min=1, help="New tokens per request (ignore_eos)."),
    max_batch_size: int = typer.Option(4, min=1, help="Engine batch size."),
    max_waiting: int = typer.Option(8, min=-1, help="Engine queue beyond the batch (admission "
                                    "bound); -1 = unbounded, the behaviour without admission control."),
    k: int = typer.Option(4, min=0, help="Drafted tokens per step (suffix drafter)."),
    threads: int = typer.Option(1, min=1, help="Server torch threads."),
    calibrate: float = typer.Option(10.0, min=1, help="Seconds of closed-loop capacity measurement."),
    json_out: bool = json_option(),
) -> None:
    """Overload a loopback server at FACTOR x its capacity: 429s, not errors or unbounded memory."""
    print_json(run(tiny, duration, factor, max_tokens, max_batch_size, max_waiting, k, threads, calibrate),
               json_out)
