"""HTTP serving benchmark: a bounded load generator on loopback against `bentoml serve service:CapsuleService`.

Prints, in one run: raw runtime throughput at batch sizes 1, 8 and 32 (no HTTP), then for adaptive batching on and
off, throughput and p50/p95/p99 latency of POST /classify at concurrency 1, 8 and 32 (a fixed number of requests
each), and the server's resident memory over a long run. The load generator shares the machine's cores with the
server: on a small machine its own CPU time is part of what is measured.

    python benchmarks/bench_http.py                       # random-weight cifar10-resnet unless models/cifar10 exists
    python benchmarks/bench_http.py --model models/cifar10 --requests 500 --rss-requests 10000
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import psutil
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from capserve import images  # noqa: E402
from capserve.runtime import load_runtime  # noqa: E402


def random_model(directory: Path) -> Path:
    """A random-weight cifar10-resnet with its ONNX graphs (when the shipped model is not there)."""
    import torch
    from capserve.export.onnx import export_onnx

    import capserve

    torch.manual_seed(0)
    model = capserve.create_model("cifar10-resnet").eval()
    model.save(directory)
    export_onnx(model, directory / "model.onnx")
    return directory


def pngs(count: int, size: int) -> list[bytes]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(count):
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buffer, "PNG")
        out.append(buffer.getvalue())
    return out


def raw_throughput(model: Path, batch_sizes: list[int], seconds: float) -> dict[int, float]:
    """Images per second of runtime.predict alone, median of repeated timed runs per batch size."""
    runtime = load_runtime(model / "model.onnx", "onnxruntime", "cpu")
    meta = runtime.metadata
    result = {}
    for B in batch_sizes:
        x = images.normalize_images(np.random.default_rng(B).integers(0, 256, (B, *meta.input_shape), np.uint8), meta)
        runtime.predict(x)
        times = []
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline or len(times) < 3:
            t = time.perf_counter()
            runtime.predict(x)
            times.append(time.perf_counter() - t)
        result[B] = B / float(np.median(times))
    return result


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: Path, tmp: Path, **env: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"server-{self.port}.log"
        environ = {**os.environ, "BENTOML_HOME": str(tmp / "bentoml"), "BENTOML_DO_NOT_TRACK": "True",
                   "CAPSERVE_MODEL": str(model), "CAPSERVE_MULTILABEL_MODEL": "none", **env}  # fmt: skip
        bentoml = str(Path(sys.executable).with_name("bentoml"))
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen([bentoml, "serve", "service:CapsuleService", "--host", "127.0.0.1",
                                          "--port", str(self.port)], cwd=ROOT, env=environ, stdout=out,
                                         stderr=subprocess.STDOUT)  # fmt: skip
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"server exited:\n{self.log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise SystemExit(f"server not ready:\n{self.log.read_text()[-2000:]}")

    def rss_mib(self) -> float:
        """Resident memory of the server and its workers."""
        root = psutil.Process(self.proc.pid)
        return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)]) / 2**20

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


async def load(url: str, bodies: list[bytes], requests: int, concurrency: int) -> tuple[float, np.ndarray, dict]:
    """``requests`` POST /classify, at most ``concurrency`` in flight: (seconds, latencies in ms, errors)."""
    latencies: list[float] = []
    errors: dict[str, int] = {}
    next_index = 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:

        async def worker() -> None:
            nonlocal next_index
            while next_index < requests:
                i = next_index
                next_index += 1
                t = time.perf_counter()
                try:
                    r = await client.post("/classify?top_k=1", content=bodies[i % len(bodies)],
                                          headers={"content-type": "image/png"})  # fmt: skip
                    status = str(r.status_code)
                except httpx.HTTPError as e:
                    status = type(e).__name__
                latencies.append((time.perf_counter() - t) * 1000)
                if status != "200":
                    errors[status] = errors.get(status, 0) + 1

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - start, np.array(latencies), errors


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=ROOT / "models" / "cifar10", help="model directory with model.onnx")
    p.add_argument("--requests", type=int, default=300, help="requests per concurrency level")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--rss-requests", type=int, default=3000, help="requests of the memory run (concurrency 32)")
    p.add_argument("--max-latency-ms", type=int, default=10_000, help="adaptive batching latency budget (503 above)")
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model = args.model
        if not (model / "model.onnx").is_file():
            print(f"{model}/model.onnx not found: benchmarking a random-weight cifar10-resnet", flush=True)
            model = random_model(tmp / "cifar10")
        meta = load_runtime(model / "model.onnx").metadata
        bodies = pngs(64, meta.image_size)
        print(f"model {meta.name}, T={meta.iterations}, input {meta.input_shape}, {os.cpu_count()} CPUs, "
              f"{args.requests} requests per level", flush=True)  # fmt: skip

        raw = raw_throughput(model, sorted({1, *args.concurrency}), seconds=3.0)
        print("\nraw runtime (onnxruntime CPU, no HTTP)")
        for B, ips in raw.items():
            print(f"  batch {B:3d}: {ips:8.1f} images/s")

        print("\nHTTP POST /classify (raw PNG body)")
        print(f"  {'batching':10s} {'conc':>4s} {'req/s':>8s} {'p50 ms':>8s} {'p95 ms':>8s} {'p99 ms':>8s} "
              f"{'errors':>6s} {'vs raw@B':>8s}")  # fmt: skip
        for batching in (True, False):
            env = {"CAPSERVE_MAX_BATCH_SIZE": str(max(args.concurrency)) if batching else "1",
                   "CAPSERVE_MAX_LATENCY_MS": str(args.max_latency_ms)}  # fmt: skip
            server = Server(model, tmp, **env)
            try:
                asyncio.run(load(server.url, bodies, 50, 8))  # warm-up
                for c in args.concurrency:
                    seconds, lat, errors = asyncio.run(load(server.url, bodies, args.requests, c))
                    rps = args.requests / seconds
                    print(f"  {'on' if batching else 'off':10s} {c:4d} {rps:8.1f} {np.percentile(lat, 50):8.1f} "
                          f"{np.percentile(lat, 95):8.1f} {np.percentile(lat, 99):8.1f} {sum(errors.values()):6d} "
                          f"{rps / raw[c]:8.0%} {errors or ''}", flush=True)  # fmt: skip
                if batching and args.rss_requests:
                    rss = [server.rss_mib()]
                    step = max(args.rss_requests // 10, 1)
                    total_errors: dict[str, int] = {}
                    for _ in range(0, args.rss_requests, step):
                        _, _, errors = asyncio.run(load(server.url, bodies, step, 32))
                        for k, v in errors.items():
                            total_errors[k] = total_errors.get(k, 0) + v
                        rss.append(server.rss_mib())
                    print(f"\nresident memory over {args.rss_requests} requests (batching on, concurrency 32): "
                          f"start {rss[0]:.0f} MiB, end {rss[-1]:.0f} MiB, max {max(rss):.0f} MiB, "
                          f"drift {rss[-1] / rss[0] - 1:+.1%}, errors {total_errors or 0}")  # fmt: skip
                    print("  per step: " + " ".join(f"{r:.0f}" for r in rss), flush=True)
            finally:
                server.stop()


if __name__ == "__main__":
    main()
