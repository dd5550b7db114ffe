"""Where a served request's CPU goes: ``POST /classify`` under load, per thread and per part of the request path.

For each ``--configs`` backend:precision (default: ONNX Runtime fp32, the folder's INT8 graph where it has one, torch
fp32, and torch bf16 on a CPU with native bf16), one ``bentoml serve`` of capserve's service (one worker, adaptive
batching up to 32), loaded by 32 concurrent keep-alive clients (``capserve.serving.loadtest``, one 32×32 PNG as
multipart) for ``--seconds``, prints:

- requests/s, and the server's CPU ms per request (user + system of its processes, over the load);
- the worker's CPU ms per request by thread: its event loop (the main thread: HTTP, parsing, decoding, answers),
  the threads that call the runtime (Python threads), and the runtime's own thread pools (native threads);
- with py-spy installed (``pip install py-spy``; it reads the worker's stacks from outside, 100 samples/s), the
  Python threads' CPU split by part of the request path: each sample goes to the innermost frame that names a part
  (HTTP server, request parsing, decoding, batching, inference, answers, response/JSON; ``other`` is the event
  loop's own work), weighted by its thread's measured CPU time; samples where the event loop waits in ``select``
  (for sockets or for the GIL) cost no CPU and are left out;
- the raw runtime beside it: images/s and CPU ms per image at batch 32 in this process, on every core.

The load generator runs on the same cores as the server: on a small machine its CPU is not the server's, but its
presence is. Figures: docs/benchmarks/serving.md ("Where a request's CPU goes").

    python benchmarks/profile_http.py                                   # models/cifar10, 20 s per configuration
    python benchmarks/profile_http.py --configs onnxruntime:fp32 torch:bf16 --seconds 30
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from capserve.hardware import available_cores, cpu_info
from capserve.runtime import load_runtime
from capserve.runtime.precision import native_bf16, sample_images
from capserve.serving.loadtest import load, random_png, running_server

ROOT = Path(__file__).resolve().parents[1]


# A sample belongs to the innermost frame matching one of these (the frame's text is "function (file:line)").
PARTS = {
    "inference": ("capserve/runtime/", "onnxruntime/", "torch/", "capserve/model/", "capserve/routing/"),
    "decoding": ("capserve/data/images.py", "PIL/", "capserve/pipeline/decoding.py"),
    "answers": ("capserve/pipeline/answer", "capserve/pipeline/schemas.py", "capserve/serving/schemas.py"),
    "batching": ("capserve/serving/batching.py", "bentoml/_internal/marshal/"),
    "request parsing": ("multipart", "capserve/serving/guard.py", "capserve/serving/bodies.py", "_bentoml_impl/serde"),
    "response, JSON": ("pydantic", "json/", "orjson", "_bentoml_sdk/io_models.py"),
    "HTTP server": (
        "uvicorn/",
        "h11/",
        "httptools",
        "starlette/",
        "_bentoml_impl/server/",
        "bentoml/_internal/server/",
    ),
}
WAITING = re.compile(r"^(select|poll) \(selectors\.py")  # the event loop's wait: idle, or for the GIL


def configs_here(model: Path) -> list[str]:
    configs = ["onnxruntime:fp32"]
    if (model / "model-int8.onnx").is_file():
        configs.append("onnxruntime:int8")
    configs.append("torch:fp32")
    if native_bf16().native:
        configs.append("torch:bf16")
    return configs


def server_environment(home: Path, model: Path, config: str) -> dict[str, str]:
    backend, precision = config.split(":")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAPSERVE_")}
    return {
        **env,
        "CAPSERVE_MODEL": str(model / "model-int8.onnx" if precision == "int8" else model),
        "CAPSERVE_MULTILABEL_MODEL": "none",
        "CAPSERVE_UI": "0",
        "CAPSERVE_WORKERS": "1",
        "CAPSERVE_MAX_BATCH_SIZE": "32",
        "CAPSERVE_TUNED": "none",
        "CAPSERVE_CACHE_DIR": str(home / "cache"),
        "CAPSERVE_BACKEND": backend,
        **({"CAPSERVE_PRECISION": precision} if backend == "torch" else {}),
        "BENTOML_HOME": str(home / "bentoml"),
        "BENTOML_DO_NOT_TRACK": "True",
    }


def raw(model: Path, config: str, batches: int = 8) -> tuple[float, float]:
    """(images/s, CPU ms per image) of the configuration's runtime at batch 32 in this process, every core."""
    backend, precision = config.split(":")
    if backend == "torch":
        runtime = load_runtime(model, "torch", precision=precision)
    else:
        runtime = load_runtime(model / ("model-int8.onnx" if precision == "int8" else "model.onnx"))
    x = sample_images(runtime.metadata, 32)  # (32, C, H, W)
    runtime.infer(x)
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(batches):
        runtime.infer(x)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return 32 * batches / wall, 1000 * cpu / (32 * batches)


def thread_seconds(process: psutil.Process) -> dict[int, float]:
    return {t.id: t.user_time + t.system_time for t in process.threads()}


def python_threads(samples: Path) -> dict[int, collections.Counter]:
    """py-spy's raw samples by thread id: part → samples (waiting samples left out)."""
    parts: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in samples.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        thread = int(re.search(r"\((\d+)\)", frames[0]).group(1))  # "thread (TID): name"
        if WAITING.match(frames[-1]):
            parts[thread]["(waiting)"] += int(count)
            continue
        part = next((p for f in reversed(frames[1:]) for p, marks in PARTS.items() if any(m in f for m in marks)), None)
        parts[thread][part or "other"] += int(count)
    return parts


def profile(model: Path, config: str, home: Path, seconds: float, bodies: list[bytes]) -> None:
    with running_server(server_environment(home, model, config), home) as url:
        asyncio.run(load(url, bodies, 10**9, 32, "/classify", seconds=min(5.0, seconds / 3), field="image"))
        family = psutil.Process().children(recursive=True)
        worker = max(family, key=lambda p: p.memory_info().rss)  # the process that holds the model
        cpu_before = sum(sum(p.cpu_times()[:2]) for p in family)
        threads_before = thread_seconds(worker)
        spy, samples = None, home / f"{config.replace(':', '-')}.txt"
        command = shutil.which("py-spy", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
        if command:
            options = ["-r", "100", "-d", str(int(seconds)), "-f", "raw", "-o", str(samples), "--threads"]
            spy = subprocess.Popen(
                [command, "record", "-p", str(worker.pid), *options, "--nonblocking"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        took, latencies, errors = asyncio.run(load(url, bodies, 10**9, 32, "/classify", seconds=seconds, field="image"))
        cpu = sum(sum(p.cpu_times()[:2]) for p in family) - cpu_before
        threads = {t: s - threads_before.get(t, 0.0) for t, s in thread_seconds(worker).items()}
        if spy is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                spy.wait(seconds + 30)
    n = max(1, len(latencies))
    per_request = {t: 1000 * s / n for t, s in threads.items() if s > 0}
    parts = python_threads(samples) if spy is not None and samples.is_file() else {}
    loop = per_request.get(worker.pid, 0.0)
    callers = sum(ms for t, ms in per_request.items() if t != worker.pid and t in parts)
    native = sum(ms for t, ms in per_request.items() if t != worker.pid and t not in parts)
    rate, raw_rate, raw_cpu = len(latencies) / took, *raw(model, config)
    print(f"\n## {config}: {rate:.1f} req/s at c=32, errors {errors or 0}; server CPU {1000 * cpu / n:.2f} ms/request")
    print(f"raw {config}, batch 32, every core: {raw_rate:.1f} img/s, {raw_cpu:.2f} CPU ms per image")
    if not parts:
        print(f"worker: event loop {loop:.2f} ms/request, other threads {callers + native:.2f} (no py-spy: no split)")
        return
    print(
        f"worker, CPU ms per request: event loop {loop:.2f}, threads calling the runtime {callers:.2f}, "
        f"the runtime's own thread pools {native:.2f}"
    )
    by_part: collections.Counter = collections.Counter()
    for thread, counts in parts.items():
        busy = sum(v for k, v in counts.items() if k != "(waiting)")
        for part, count in counts.items():
            if part != "(waiting)" and busy:
                by_part[part] += per_request.get(thread, 0.0) * count / busy
    print("| part | CPU ms per request (Python threads) |")
    print("|---|---|")
    for part in [*PARTS, "other"]:
        print(f"| {part} | {by_part.get(part, 0.0):.2f} |")
    print(f"| the runtime's own thread pools | {native:.2f} |")


def main() -> None:
    print(f"# CPU: {cpu_info().describe()}", flush=True)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=ROOT / "models" / "cifar10")
    p.add_argument("--configs", nargs="+", help="backend:precision (onnxruntime:fp32|int8, torch:fp32|bf16)")
    p.add_argument("--seconds", type=float, default=20.0, help="seconds of load per configuration")
    args = p.parse_args()
    configs = args.configs or configs_here(args.model)
    for config in configs:
        if config not in ("onnxruntime:fp32", "onnxruntime:int8", "torch:fp32", "torch:bf16"):
            p.error(f"--configs {config}: use onnxruntime:fp32, onnxruntime:int8, torch:fp32 or torch:bf16")
    print(f"# {available_cores()} cores; {args.model}; 32 clients, {args.seconds:g} s each", flush=True)
    bodies = [random_png(32, seed) for seed in range(16)]
    with tempfile.TemporaryDirectory(prefix="capserve-profile-") as tmp:
        home = Path(tmp)
        (home / "bentoml").mkdir()
        for config in configs:
            profile(args.model, config, home, args.seconds, bodies)


if __name__ == "__main__":
    main()
