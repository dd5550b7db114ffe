"""The default server against the one ``capserve tune`` configures, on this machine: does a server started with no
setting and no tuned file serve as fast as a tuned one?

Prints the CPU; the start-up measurement's choice (``capserve.serving.runtimes``) and how long the first start and
a restart (the kept figures) took to be ready; then requests/s and p50 of ``POST /classify`` (one 32x32 PNG, 32
concurrent keep-alive clients, ``capserve.serving.loadtest``), with the server's CPU time per request (its
processes' user + system time over the load), for three servers, in interleaved rounds (medians):
``default`` (nothing set: the start-up measurement chooses), ``fp32`` (``CAPSERVE_MEASURE_RUNTIMES=0``: ONNX Runtime
fp32, the default before the measurement), and ``tuned`` (the file ``capserve tune MODEL --budget B`` writes). The
load generator is Python on the same cores: on a small machine its CPU is part of what is measured, alike for all.

    python benchmarks/bench_default_server.py                      # models/cifar10, tune --budget 240, 3 rounds
    python benchmarks/bench_default_server.py --budget 60 --rounds 2 --seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import psutil

from capserve.hardware import available_cores, cpu_info
from capserve.runtime import load_runtime
from capserve.runtime.precision import sample_images
from capserve.serving.loadtest import load, random_png, running_server

ROOT = Path(__file__).resolve().parents[1]


def environment(home: Path, model: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAPSERVE_")}
    return {
        **env,
        "CAPSERVE_MODEL": model,
        "CAPSERVE_MULTILABEL_MODEL": "none",
        "CAPSERVE_UI": "0",
        "CAPSERVE_CACHE_DIR": str(home / "cache"),
        "BENTOML_HOME": str(home / "bentoml"),
        "BENTOML_DO_NOT_TRACK": "True",
        **extra,
    }


def server_cpu_seconds() -> float:
    """CPU seconds (user + system) of every process this one started: the server and its workers."""
    total = 0.0
    for process in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            times = process.cpu_times()
            total += times.user + times.system
    return total


def raw(path: Path, batches: int = 10) -> tuple[float, float]:
    """(images/s, CPU ms per image) of ONNX Runtime on batches of 32 of ``path`` in this process, every core."""
    runtime = load_runtime(path, threads=available_cores())
    x = sample_images(runtime.metadata, 32)  # (32, C, H, W)
    runtime.predict(x)
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(batches):
        runtime.predict(x)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return 32 * batches / wall, 1000 * cpu / (32 * batches)


def main() -> None:
    print(f"# CPU: {cpu_info().describe()}", flush=True)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / "models" / "cifar10"))
    p.add_argument("--budget", type=float, default=240.0, help="capserve tune --budget (default %(default)g s)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=15.0, help="seconds of load per server and round")
    args = p.parse_args()
    bodies = [random_png(32, seed) for seed in range(16)]
    with tempfile.TemporaryDirectory(prefix="capserve-bench-") as tmp:
        home = Path(tmp)
        (home / "bentoml").mkdir()
        for start in ("first start (measures)", "restart (kept figures)"):
            began = time.monotonic()
            with running_server(environment(home, args.model, CAPSERVE_TUNED="none"), home) as url:
                ready = time.monotonic() - began
                chosen = httpx.get(f"{url}/model", timeout=30).json()["choices"]
            print(
                f"# default server, {start}: ready after {ready:.1f} s; backend {chosen['backend']['value']}, "
                f"graph {chosen['artifact']['value']}: {chosen['backend']['set_by']}",
                flush=True,
            )
        tuned = home / "tuned.json"
        command = [str(Path(sys.executable).with_name("capserve")), "tune", args.model, "--budget", str(args.budget)]
        subprocess.run([*command, "--out", str(tuned)], env=environment(home, args.model), check=True)
        print(f"# capserve tune --budget {args.budget:g} chose: {json.loads(tuned.read_text())['settings']}")
        servers = {
            "default": environment(home, args.model, CAPSERVE_TUNED="none"),
            "fp32": environment(home, args.model, CAPSERVE_TUNED="none", CAPSERVE_MEASURE_RUNTIMES="0"),
            "tuned": environment(home, args.model, CAPSERVE_TUNED=str(tuned)),
        }
        for graph in ("model.onnx", "model-int8.onnx"):
            if (Path(args.model) / graph).is_file():
                speed, cpu = raw(Path(args.model) / graph)
                print(f"# raw ONNX Runtime {graph}, batch 32: {speed:.1f} img/s, {cpu:.2f} ms of CPU per image")
        rates: dict[str, list[float]] = {name: [] for name in servers}
        p50s: dict[str, list[float]] = {name: [] for name in servers}
        cpu_ms: dict[str, list[float]] = {name: [] for name in servers}
        for r in range(args.rounds):
            for name, env in servers.items():
                with running_server(env, home) as url:
                    asyncio.run(load(url, bodies, 10**9, 32, seconds=args.seconds / 3))  # warm-up
                    before = server_cpu_seconds()
                    took, latencies, errors = asyncio.run(load(url, bodies, 10**9, 32, seconds=args.seconds))
                    cpu_ms[name].append(1000 * (server_cpu_seconds() - before) / len(latencies))
                rates[name].append(len(latencies) / took)
                p50s[name].append(float(np.percentile(latencies, 50)))
                print(f"# round {r + 1} {name}: {rates[name][-1]:.1f} req/s, errors {errors}", flush=True)
        print("| server | req/s at 32 (median) | p50 ms | vs tuned | server CPU ms per request |")
        print("|---|---|---|---|---|")
        best = statistics.median(rates["tuned"])
        for name in servers:
            rate, cpu = statistics.median(rates[name]), statistics.median(cpu_ms[name])
            print(f"| {name} | {rate:.1f} | {statistics.median(p50s[name]):.1f} | {rate / best:.2f} | {cpu:.2f} |")


if __name__ == "__main__":
    main()
