"""HTTP serving benchmark: a bounded load generator on loopback against `bentoml serve service:CapsuleService`.

Prints, in one run, for each served configuration (backend and precision, e.g. onnxruntime:fp32, torch:bf16):
the raw runtime's throughput (no HTTP) at batch sizes 1, 8 and 32 and of explanations at batch 1, then, with
adaptive batching on and/or off, throughput and p50/p95/p99 latency over HTTP of POST /classify at concurrency 1,
8 and 32, /explain and /multilabel at concurrency 1 and 8, and /classify_batch (32 images per request), each beside
the raw figure it corresponds to; and the server's resident memory over a long run. The load generator shares the
machine's cores with the server: on a small machine its own CPU time is part of what is measured.

    python benchmarks/bench_http.py                       # random-weight cifar10-resnet unless models/cifar10 exists
    python benchmarks/bench_http.py --model models/cifar10 --requests 500 --rss-requests 10000
    python benchmarks/bench_http.py --configs onnxruntime:fp32 torch:bf16 torch:fp32 --batching on --rss-requests 0

First, the comparison with the alternatives a user could write, at each ``--table-configs`` precision (ONNX Runtime
fp32; the folder's INT8 graph where it has one; torch bf16 on a CPU with native bf16), with ``wrk`` as the load
generator (C, one thread: it takes little of the server's CPU; where wrk is not installed, capserve's Python load
generator, named in the table's heading) POSTing one 32×32 PNG as multipart (``benchmarks/multipart.lua``) to one
server at a time (the others paused with SIGSTOP), servers interleaved over ``--table-rounds`` rounds, medians
printed: the raw runtime at batch 32 in-process, then requests/s and p50 at each ``--table-concurrency`` (1, 32,
128; req/s at 32 also ÷ raw) and the server's CPU time per request at the largest (and its event loops' share; raw's
CPU per image beside it), and for servers with several workers how the connections at c=32 fell to them, for plain
FastAPI servers (one image per run, ``benchmarks/peers/fastapi_server.py``: ``/classify``, and ``/multilabel`` on
the multi-label model; ONNX Runtime once with its default session options, once with those a careful user sets,
``intra_op_num_threads`` = the cores and ``inter_op_num_threads`` = 1; torch under ``inference_mode`` and autocast),
LitServe with dynamic batching (max 32, 5 ms, ``benchmarks/peers/litserve_server.py``), and capserve's ``/classify``
and ``/multilabel`` with each ``--table-workers`` count (CAPSERVE_WORKERS; 1 and 2) (each ``/multilabel`` against
the multi-label model's raw figure). The peers are benchmark tools, not capserve dependencies. Set-up, once::

    apt-get install -y wrk                                  # or build it from https://github.com/wg/wrk
    .venv/bin/pip install fastapi uvicorn litserve           # the peers (a missing one is skipped with a note)
    python benchmarks/bench_http.py --table-only             # the table alone (about 10 minutes with 3 rounds)
    python benchmarks/bench_http.py --table-only --table-configs torch:bf16 --table-workers 1
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from capserve.data.preprocess import normalize_images  # noqa: E402
from capserve.hardware import cpu_info  # noqa: E402
from capserve.runtime import Runtime, load_runtime  # noqa: E402
from capserve.runtime.precision import native_bf16  # noqa: E402
from capserve.serving.loadtest import load  # noqa: E402


def random_model(directory: Path) -> Path:
    """A random-weight cifar10-resnet with its ONNX graphs (when the shipped model is not there)."""
    import torch

    import capserve
    from capserve.export.onnx import export_onnx

    torch.manual_seed(0)
    model = capserve.create_model("cifar10-resnet").eval()
    model.save(directory)
    export_onnx(model, directory / "model.onnx")
    export_onnx(model, directory / "model-explain.onnx", explain=True)
    return directory


def pngs(count: int, size: int) -> list[bytes]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(count):
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buffer, "PNG")
        out.append(buffer.getvalue())
    return out


GRAPHS = {"fp32": "model.onnx", "int8": "model-int8.onnx"}  # ONNX Runtime's graph of each precision in a folder


def open_runtime(model: Path, config: str, explain: bool = False) -> Runtime:
    """The runtime a server with ``config`` ("backend:precision") uses for predictions (or for /explain)."""
    backend, precision = config.split(":")
    if backend == "torch":
        return load_runtime(model, "torch", "cpu", precision=precision)
    return load_runtime(model / ("model-explain.onnx" if explain else GRAPHS[precision]), backend, "cpu")


def interleaved(calls: dict[str, Callable[[], object]], seconds: float) -> dict[str, float]:
    """Median seconds per call of each of ``calls``, timed in turn (A, B, A, B, ...) for ``seconds`` in all and at
    least 5 rounds, after one untimed call each: every variant sees the same background load."""
    for fn in calls.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in calls}
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(next(iter(times.values()))) < 5:
        for name, fn in calls.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {name: float(np.median(t)) for name, t in times.items()}


def raw_throughput(
    model: Path, configs: list[str], batch_sizes: list[int], seconds: float, explain: bool = True
) -> dict[str, dict[str, float]]:
    """Images per second of each configuration's runtime alone, interleaved: config → {"predict@B": ..., and
    "explain@1" when ``explain``}.

    Timed in a worker thread, as the server runs inference (anyio worker threads): on a CPU shared with other
    work, torch's OpenMP threads in the main thread collapse (measured in one process on this loaded 2-core
    machine: bf16 batch 1 at 1.2 images/s from the main thread, 42.8 from a worker thread).
    """
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(_raw_throughput, model, configs, batch_sizes, seconds, explain).result()


def _raw_throughput(
    model: Path, configs: list[str], batch_sizes: list[int], seconds: float, explain: bool
) -> dict[str, dict[str, float]]:
    runtimes = {config: open_runtime(model, config) for config in configs}
    meta = next(iter(runtimes.values())).metadata
    result: dict[str, dict[str, float]] = {config: {} for config in configs}
    for B in batch_sizes:
        x = normalize_images(np.random.default_rng(B).integers(0, 256, (B, *meta.input_shape), np.uint8), meta)
        medians = interleaved({c: (lambda r=r, x=x: r.predict(x)) for c, r in runtimes.items()}, seconds)
        for config, median in medians.items():
            result[config][f"predict@{B}"] = B / median
    if explain:
        has_graph = (model / "model-explain.onnx").is_file()
        explainers = {c: open_runtime(model, c, explain=True) if has_graph else r for c, r in runtimes.items()}
        x = normalize_images(np.zeros((1, *meta.input_shape), np.uint8), meta)
        medians = interleaved({c: (lambda r=r: r.explain(x)) for c, r in explainers.items()}, seconds)
        for config, median in medians.items():
            result[config]["explain@1"] = 1 / median
    return result


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen, log: Path, probe: Callable[[], httpx.Response], timeout: float = 120) -> str:
    """Polls ``probe`` until it answers 200: "" when it did, else what went wrong with the log's tail."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"exited:\n{log.read_text()[-2000:]}"
        try:
            if probe().status_code == 200:
                return ""
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    return f"not ready:\n{log.read_text()[-2000:]}"


class Server:
    def __init__(self, model: Path, multilabel: Path | None, tmp: Path, **env: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"server-{self.port}.log"
        environ = {
            **os.environ,
            "BENTOML_HOME": str(tmp / "bentoml"),
            "BENTOML_DO_NOT_TRACK": "True",
            "CAPSERVE_MODEL": str(model),
            "CAPSERVE_MULTILABEL_MODEL": str(multilabel or "none"),
            **env,
        }
        bentoml = str(Path(sys.executable).with_name("bentoml"))
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [bentoml, "serve", "service:CapsuleService", "--host", "127.0.0.1", "--port", str(self.port)],
                cwd=ROOT,
                env=environ,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        error = wait_ready(self.proc, self.log, lambda: httpx.get(f"{self.url}/readyz", timeout=2), 180)
        if error:
            self.stop()
            raise SystemExit(f"server {error}")

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


def measure(servers: dict[str, Server], rounds: int, requests: int, *args: Any, **kwargs: Any) -> dict[str, tuple]:
    """``load`` against every server in turn, ``rounds`` times (``requests`` in all per server): each server sees
    the same background load. Server name → (seconds, latencies in ms, errors)."""
    totals: dict[str, list] = {name: [0.0, [], {}] for name in servers}
    for _ in range(rounds):
        for name, server in servers.items():
            seconds, latencies, errors = asyncio.run(
                load(server.url, *args[:1], max(requests // rounds, 1), *args[1:], **kwargs)
            )
            total = totals[name]
            total[0] += seconds
            total[1].extend(latencies)
            for k, v in errors.items():
                total[2][k] = total[2].get(k, 0) + v
    return {name: (seconds, np.array(latencies), errors) for name, (seconds, latencies, errors) in totals.items()}


def row(name: str, endpoint: str, c: int, result: tuple[float, np.ndarray, dict], images_per: int, raw: float) -> None:
    seconds, lat, errors = result
    ips = len(lat) * images_per / seconds
    print(
        f"  {name:26s} {endpoint:18s} {c:4d} {ips:8.1f} {np.percentile(lat, 50):8.1f} {np.percentile(lat, 95):8.1f} "
        f"{np.percentile(lat, 99):8.1f} {sum(errors.values()):6d} {ips / raw:8.0%} {errors or ''}",
        flush=True,
    )


# ------------------------------------------------------------------------------------ the peers table, with wrk

WRK_SCRIPT = ROOT / "benchmarks" / "multipart.lua"
PEERS = ROOT / "benchmarks" / "peers"


class PeerServer:
    """A benchmark peer (FastAPI or LitServe) in its own process, ready once it answers ``/classify`` with 200."""

    def __init__(self, name: str, command: list[str], tmp: Path, png: Path, env: dict[str, str] | None = None):
        self.name, self.port = name, int(command[-1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"peer-{self.port}.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                command,
                cwd=ROOT,
                env={**os.environ, **(env or {})},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        files = {"image": ("image.png", png.read_bytes(), "image/png")}
        error = wait_ready(self.proc, self.log, lambda: httpx.post(f"{self.url}/classify", files=files, timeout=5))
        if error:
            self.stop()
            raise RuntimeError(f"{name} {error}")

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)  # LitServe runs its inference workers as child processes
            self.proc.wait(20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def process_tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a server and its child processes so far."""
    total = 0.0
    for p in process_tree(pid):
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def loop_seconds(pid: int) -> float:
    """CPU seconds so far of the main threads of a server's processes: their event loops (BentoML's workers and
    uvicorn run theirs there), apart from inference and worker threads."""
    total = 0.0
    for p in process_tree(pid):
        with contextlib.suppress(psutil.Error):
            total += sum(t.user_time + t.system_time for t in p.threads() if t.id == p.pid)
    return total


def pause(pid: int, paused: bool) -> None:
    """SIGSTOP (or SIGCONT) a server's process tree: one server at a time gets the CPU."""
    for p in process_tree(pid):
        with contextlib.suppress(psutil.NoSuchProcess):
            p.suspend() if paused else p.resume()


def connections_per_worker(server: Any, after: float) -> list[int]:
    """After ``after`` seconds, the established connections on ``server``'s port held by each of its processes
    (most first): with several BentoML workers, which worker accepted how many of the clients' connections."""
    time.sleep(after)
    port = urllib.parse.urlsplit(server.url).port
    counts = []
    for p in process_tree(server.proc.pid):
        with contextlib.suppress(psutil.Error):
            held = [c for c in p.net_connections("tcp") if c.status == "ESTABLISHED" and c.laddr.port == port]
            if held:
                counts.append(len(held))
    return sorted(counts, reverse=True)


def run_wrk(url: str, png: Path, concurrency: int, seconds: int) -> dict[str, float]:
    """One ``wrk`` run (one thread, ``concurrency`` connections) POSTing ``png`` as multipart: its summary."""
    env = {**os.environ, "WRK_FILE": str(png), "WRK_FIELD": "image", "WRK_TYPE": "image/png"}
    out = subprocess.run(
        ["wrk", "-t1", f"-c{concurrency}", f"-d{seconds}s", "--timeout", "60s", "-s", str(WRK_SCRIPT), url],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    line = next(line for line in out.stdout.splitlines() if line.startswith("WRK_JSON "))
    return json.loads(line.removeprefix("WRK_JSON "))


def run_python(url: str, png: Path, concurrency: int, seconds: int) -> dict[str, float]:
    """``run_wrk``'s summary from capserve's Python load generator (``capserve.serving.loadtest``), for machines
    without wrk: the same multipart POSTs, but the generator takes more of the server's CPU than wrk does."""
    parsed = urllib.parse.urlsplit(url)
    took, latencies, errors = asyncio.run(
        load(
            f"{parsed.scheme}://{parsed.netloc}",
            [png.read_bytes()],
            10**9,
            concurrency,
            parsed.path,
            seconds=seconds,
            field="image",
        )
    )
    codes = {code: n for code, n in errors.items() if code.isdigit()}
    return {
        "requests": len(latencies),
        "seconds": took,
        "p50_ms": float(np.percentile(latencies, 50)) if len(latencies) else float("nan"),
        "connect": sum(n for code, n in errors.items() if not code.isdigit()),
        "read": 0,
        "write": 0,
        "timeout": 0,
        "codes": codes,
    }


class RawMeter:
    """Raw throughput at batch 32 of each (model, "backend:precision") in-process, in a worker thread (as the server
    runs inference): measured right before each server's turn, so that each ratio compares figures taken under the
    same background load."""

    def __init__(self, models: dict[str, Path], configs: list[str]):
        self.pool = ThreadPoolExecutor(1)
        self.cpu_ms: list[float] = []  # this process's CPU ms per image of each measurement, in order
        self.runtimes = {
            (key, config): open_runtime(path, config) for key, path in models.items() for config in configs
        }
        self.inputs = {}
        for key, runtime in self.runtimes.items():
            pixels = np.random.default_rng(0).integers(0, 256, (32, *runtime.metadata.input_shape), np.uint8)
            self.inputs[key] = normalize_images(pixels, runtime.metadata)  # (32, C, H, W)
            runtime.predict(self.inputs[key])  # warm-up

    def __call__(self, key: tuple[str, str], seconds: float) -> float:
        """Images per second of (model, config): the median batch of those run in ``seconds`` (at least 3)."""
        return self.pool.submit(self._measure, key, seconds).result()

    def _measure(self, key: tuple[str, str], seconds: float) -> float:
        runtime, x = self.runtimes[key], self.inputs[key]
        times: list[float] = []
        deadline = time.perf_counter() + seconds
        cpu = time.process_time()
        while time.perf_counter() < deadline or len(times) < 3:
            t = time.perf_counter()
            runtime.predict(x)
            times.append(time.perf_counter() - t)
        self.cpu_ms.append(1000 * (time.process_time() - cpu) / (len(x) * len(times)))
        return len(x) / float(np.median(times))


def peer_table(
    model: Path,
    multilabel: Path | None,
    tmp: Path,
    rounds: int,
    seconds: int,
    concurrency: list[int],
    workers: list[int],
    peers: bool = True,
    configs: tuple[str, ...] = ("onnxruntime:fp32",),
) -> None:
    """The peers table (docs/benchmarks/serving.md, "HTTP: capserve against the alternatives"), for each of
    ``configs`` ("backend:precision": the peers and capserve at the same precision), with capserve at each of
    ``workers`` (CAPSERVE_WORKERS): raw batch-32 throughput, then each server's req/s and p50 at each of
    ``concurrency`` (req/s at 32 also ÷ the raw figure of its configuration measured just before), errors and server
    CPU ms per request at the largest concurrency (medians over interleaved rounds). The load generator is wrk,
    or capserve's Python one where wrk is not installed (said in the table's heading)."""
    generator = run_wrk if shutil.which("wrk") else run_python
    meta = load_runtime(model / "model.onnx").metadata
    png = tmp / "image.png"
    png.write_bytes(pngs(1, meta.image_size)[0])
    ml_png = tmp / "multilabel.png"
    if multilabel:
        ml_png.write_bytes(pngs(1, load_runtime(multilabel / "model.onnx").metadata.image_size)[0])
    raw = RawMeter({"single": model, **({"multi": multilabel} if multilabel else {})}, list(configs))

    python, uvicorn = sys.executable, str(Path(sys.executable).with_name("uvicorn"))
    fastapi = [uvicorn, "benchmarks.peers.fastapi_server:app", "--log-level", "warning", "--port"]
    servers: dict[str, tuple[Any, str, Path, tuple[str, str]]] = {}  # row → (server, url path, upload, raw key)
    started: list[Any] = []
    figures: dict[str, dict[str, list[float]]] = {}
    busiest = max(concurrency)
    split_at = 32 if 32 in concurrency else busiest  # the concurrency whose connections per worker are printed
    try:
        for config in configs:
            backend, precision = config.split(":")
            graph = backend == "onnxruntime"  # ONNX Runtime serves the graphs, torch the model folders
            label = {"onnxruntime:fp32": "ORT"}.get(config, f"{'ORT' if graph else 'torch'} {precision}")

            def served(folder: Path, graph: bool = graph, precision: str = precision) -> Path:
                return folder / GRAPHS[precision] if graph else folder

            # the multi-label model where it has this precision's graph (an INT8 graph passes its gate or is not there)
            ml = multilabel if multilabel and served(multilabel).exists() else None
            fastapi_env = {
                "PEER_BACKEND": backend,
                "PEER_PRECISION": precision,
                "PEER_MODEL": str(served(model)),
                **({"PEER_MULTILABEL_MODEL": str(served(ml))} if ml else {}),
            }
            candidates = [(f"FastAPI + {label}{' defaults' * graph}", "fastapi", fastapi, fastapi_env)]
            if graph:
                careful = {**fastapi_env, "PEER_CAREFUL": "1"}
                candidates.append((f"FastAPI + {label} intra=cores inter=1", "fastapi", fastapi, careful))
            litserve = [python, str(PEERS / "litserve_server.py"), str(served(model))]
            peer_env = {"PEER_BACKEND": backend, "PEER_PRECISION": precision}
            candidates.append((f"LitServe + {label}, batching 32 / 5 ms", "litserve", litserve, peer_env))
            for name, module, command, env in candidates if peers else []:
                try:
                    __import__(module)
                    peer = PeerServer(name, [*command, str(free_port())], tmp, png, env)
                except (ImportError, RuntimeError) as e:
                    print(
                        f"{name}: skipped ({type(e).__name__}: {str(e)[-300:]}); `pip install fastapi uvicorn "
                        "litserve` into this venv",
                        flush=True,
                    )
                    continue
                started.append(peer)
                servers[f"{name} /classify"] = (peer, "/classify", png, ("single", config))
                if module == "fastapi" and ml:
                    servers[f"{name} /multilabel"] = (peer, "/multilabel", ml_png, ("multi", config))
            # capserve serves the folders (the graphs' explanation graph beside them), an INT8 graph by its file
            int8 = precision == "int8"
            for n in workers:
                capserve = Server(
                    served(model) if int8 else model,
                    (served(ml) if int8 else ml) if ml else None,
                    tmp,
                    CAPSERVE_MAX_BATCH_SIZE="32",
                    CAPSERVE_WORKERS=str(n),
                    CAPSERVE_BACKEND=backend,
                    **({"CAPSERVE_PRECISION": precision} if backend == "torch" else {}),
                )
                started.append(capserve)
                row = f"capserve {label}, {n} worker{'s' * (n > 1)}"
                servers[f"{row} /classify"] = (capserve, "/classify", png, ("single", config))
                if ml:
                    servers[f"{row} /multilabel"] = (capserve, "/multilabel", ml_png, ("multi", config))
        for server in started:
            pause(server.proc.pid, True)

        keys = ["raw", "raw_cpu", "cpu", "loop", "errors", "split"]
        keys += [f"{what}@{c}" for c in concurrency for what in ("rps", "p50")]
        figures = {name: {key: [] for key in keys} for name in servers}
        for _ in range(rounds):
            for name, (server, path, upload, key) in servers.items():
                f = figures[name]
                f["raw"].append(raw(key, 2.0))
                f["raw_cpu"].append(raw.cpu_ms[-1])
                pause(server.proc.pid, False)
                try:
                    generator(server.url + path, upload, 8, 1)  # warm-up
                    errors: dict[str, int] = {}
                    for c in concurrency:
                        cpu, loop = cpu_seconds(server.proc.pid), loop_seconds(server.proc.pid)
                        with ThreadPoolExecutor(1) as pool:  # which worker holds the connections, mid-run
                            split = pool.submit(connections_per_worker, server, min(1.0, seconds / 2))
                            result = generator(server.url + path, upload, c, seconds)
                        cpu = cpu_seconds(server.proc.pid) - cpu
                        loop = loop_seconds(server.proc.pid) - loop
                        f[f"rps@{c}"].append(result["requests"] / result["seconds"])
                        f[f"p50@{c}"].append(result["p50_ms"])
                        kinds = {k: result[k] for k in ("connect", "read", "write", "timeout")}
                        kinds |= {f"HTTP {code}": n for code, n in result.get("codes", {}).items()}  # non-2xx
                        for kind, n in kinds.items():
                            if n:
                                errors[f"{kind} @ c={c}"] = errors.get(f"{kind} @ c={c}", 0) + int(n)
                        if c == busiest:
                            f["cpu"].append(1000 * cpu / max(result["requests"], 1))
                            f["loop"].append(1000 * loop / max(result["requests"], 1))
                        if c == split_at:
                            f["split"].append(split.result())
                finally:
                    pause(server.proc.pid, True)
                f["errors"].append(errors)
    finally:
        for server in started:
            pause(server.proc.pid, False)
            server.stop()

    print(
        f"\npeers table: {'wrk' if generator is run_wrk else 'Python load generator (no wrk here)'}, one 32×32 PNG as "
        f"multipart, one server at a time, medians of {rounds} "
        f"interleaved rounds of {seconds:g} s per concurrency ({os.cpu_count()} CPUs); ÷ raw: req/s at c=32 against "
        f"raw batch 32 measured just before each turn; CPU: the server's CPU ms per request at c={busiest}, loop: its "
        "event loops' share of it (the processes' main threads)"
    )
    heads = "".join(f"{f'c={c} req/s':>12s}{'p50 ms':>8s}" for c in concurrency)
    print(f"  {'server':46s}{heads}{'÷ raw':>7s}{'errors':>7s}{'CPU ms':>7s}{'loop ms':>8s}")
    raw_rows = [(("single", c), f"raw {c}, batch 32, in-process") for c in configs]
    raw_rows += [(("multi", c), f"raw {c}, multi-label model, batch 32") for c in configs]
    for key, label in raw_rows:
        measured = [r for name, f in figures.items() if servers[name][3] == key for r in f["raw"]]
        if measured:
            cpu_ms = [r for name, f in figures.items() if servers[name][3] == key for r in f["raw_cpu"]]
            print(f"  {label:46s}{np.median(measured):12.1f}  (img/s; {np.median(cpu_ms):.2f} CPU ms per image)")
    for name, f in figures.items():
        cells = "".join(f"{np.median(f[f'rps@{c}']):12.1f}{np.median(f[f'p50@{c}']):8.1f}" for c in concurrency)
        ratio = np.median(np.array(f["rps@32"]) / np.array(f["raw"])) if "rps@32" in f else float("nan")
        total = sum(sum(e.values()) for e in f["errors"])
        cpu_ms = f"{np.median(f['cpu']):7.2f}{np.median(f['loop']):8.2f}"
        print(f"  {name:46s}{cells}{ratio:7.2f}{total:7d}{cpu_ms}", flush=True)
    for name, f in figures.items():  # which kind of error (socket errors, HTTP status codes), at which concurrency
        kinds: dict[str, int] = {}
        for e in f["errors"]:
            for k, v in e.items():
                kinds[k] = kinds.get(k, 0) + v
        if kinds:
            print(f"  errors of {name}: " + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())), flush=True)
    for name, f in figures.items():  # BentoML's workers share one socket: how the connections fell to them
        if any(len(split) > 1 for split in f["split"]):
            splits = ", ".join("/".join(map(str, split)) for split in f["split"])
            print(f"  connections per worker of {name} at c={split_at}, each round: {splits}", flush=True)
    for server in started:  # capserve logs why adaptive batching shed requests (its estimate of their wait)
        if isinstance(server, Server):
            for line in server.log.read_text(errors="replace").splitlines():
                if "adaptive batching has shed" in line:
                    print(f"  capserve on port {server.port}: {line.strip()}", flush=True)


def main() -> None:
    print(f"CPU: {cpu_info().describe()}", flush=True)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=ROOT / "models" / "cifar10", help="model directory with model.onnx")
    p.add_argument(
        "--multilabel-model",
        type=Path,
        default=ROOT / "models" / "multimnist",
        help="multi-label model directory for /multilabel ('none' or missing: skip)",
    )
    p.add_argument(
        "--configs",
        nargs="+",
        default=["onnxruntime:fp32", "torch:bf16"],
        help="served backend:precision pairs (default %(default)s)",
    )
    p.add_argument("--batching", nargs="+", choices=["on", "off"], default=["on", "off"])
    p.add_argument("--requests", type=int, default=300, help="requests per concurrency level and server")
    p.add_argument("--rounds", type=int, default=5, help="turns each server takes per measurement (interleaving)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--batch-images", type=int, default=32, help="images per /classify_batch request (0: skip)")
    p.add_argument("--rss-requests", type=int, default=3000, help="requests of the memory run (concurrency 32)")
    p.add_argument("--max-latency-ms", type=int, default=10_000, help="adaptive batching latency budget (503 above)")
    table = p.add_mutually_exclusive_group()
    table.add_argument("--table-only", action="store_true", help="only the peers table (wrk)")
    table.add_argument("--no-table", action="store_true", help="skip the peers table (no wrk needed)")
    p.add_argument("--table-rounds", type=int, default=3, help="interleaved rounds of the table (medians)")
    p.add_argument("--table-seconds", type=int, default=5, help="seconds of each wrk run in the table")
    p.add_argument(
        "--table-concurrency",
        type=int,
        nargs="+",
        default=[1, 32, 128],
        help="wrk connections of the table's runs (default %(default)s)",
    )
    p.add_argument(
        "--table-workers",
        type=int,
        nargs="+",
        default=[1, 2],
        help="capserve servers in the table, one per CAPSERVE_WORKERS value (default %(default)s)",
    )
    p.add_argument("--no-peers", action="store_true", help="the table without its peers: capserve servers only")
    p.add_argument(
        "--table-configs",
        nargs="+",
        help="backend:precision pairs of the table: the peers and capserve at each (default: onnxruntime:fp32, "
        "onnxruntime:int8 where the model folder has an INT8 graph, torch:bf16 on a CPU with native bf16)",
    )
    args = p.parse_args()
    if args.table_configs is None:
        args.table_configs = ["onnxruntime:fp32"]
        args.table_configs += ["onnxruntime:int8"] if (args.model / GRAPHS["int8"]).is_file() else []
        args.table_configs += ["torch:bf16"] if native_bf16().native else []
    for config in args.configs:
        if config not in ("onnxruntime:fp32", "torch:fp32", "torch:bf16"):
            p.error(f"--configs {config}: use onnxruntime:fp32, torch:fp32 or torch:bf16")
    for config in args.table_configs:
        if config not in ("onnxruntime:fp32", "onnxruntime:int8", "torch:fp32", "torch:bf16"):
            p.error(f"--table-configs {config}: use onnxruntime:fp32, onnxruntime:int8, torch:fp32 or torch:bf16")
        if config == "onnxruntime:int8" and not (args.model / GRAPHS["int8"]).is_file():
            p.error(f"--table-configs {config}: {args.model} has no {GRAPHS['int8']} (capserve export onnx --int8)")

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model = args.model
        if not (model / "model.onnx").is_file():
            print(f"{model}/model.onnx not found: benchmarking a random-weight cifar10-resnet", flush=True)
            model = random_model(tmp / "cifar10")
        multilabel = args.multilabel_model if (args.multilabel_model / "model.onnx").is_file() else None
        if not args.no_table:
            peer_table(
                model,
                multilabel,
                tmp,
                args.table_rounds,
                args.table_seconds,
                args.table_concurrency,
                args.table_workers,
                peers=not args.no_peers,
                configs=tuple(args.table_configs),
            )
            if args.table_only:
                return
        meta = load_runtime(model / "model.onnx").metadata
        bodies = pngs(64, meta.image_size)
        ml_bodies = pngs(64, load_runtime(multilabel).metadata.image_size) if multilabel else []
        print(
            f"model {meta.name}, T={meta.iterations}, input {meta.input_shape}, multi-label {multilabel}, "
            f"{os.cpu_count()} CPUs, {args.requests} requests per level and server in {args.rounds} interleaved "
            "rounds",
            flush=True,
        )

        sizes = sorted({1, 8, *args.concurrency, *([args.batch_images] if args.batch_images else [])})
        raw = raw_throughput(model, args.configs, sizes, seconds=4.0 * len(args.configs))
        ml_raw = raw_throughput(multilabel, args.configs, [1, 8], 2.0, explain=False) if multilabel else {}
        print("\nraw runtime (CPU, no HTTP, variants interleaved), images/s")
        for config, figures in raw.items():
            ml = ", ".join(f"multi-label {k} {v:.1f}" for k, v in ml_raw.get(config, {}).items())
            line = ", ".join(f"{k} {v:.1f}" for k, v in figures.items())
            print(f"  {config:16s} {line}" + (f"; {ml}" if ml else ""))

        servers: dict[str, Server] = {}
        try:
            for config in args.configs:
                backend, precision = config.split(":")
                for batching in args.batching:  # each with one worker, as docs/benchmarks/serving.md measured
                    env = {
                        "CAPSERVE_BACKEND": backend,
                        "CAPSERVE_PRECISION": precision,
                        "CAPSERVE_MAX_BATCH_SIZE": str(max(args.concurrency)) if batching == "on" else "1",
                        "CAPSERVE_MAX_LATENCY_MS": str(args.max_latency_ms),
                        "CAPSERVE_WORKERS": "1",
                    }
                    servers[f"{config} batching {batching}"] = Server(model, multilabel, tmp, **env)
            for server in servers.values():
                asyncio.run(load(server.url, bodies, 50, 8))  # warm-up

            print(
                "\nHTTP (raw PNG bodies; /classify_batch: multipart), images/s, servers interleaved; vs raw: the raw "
                "runtime at the batch the concurrency allows (classify_batch: its images per request; explain: 1)"
            )
            print(
                f"  {'server':26s} {'endpoint':18s} {'conc':>4s} {'img/s':>8s} {'p50 ms':>8s} {'p95 ms':>8s} "
                f"{'p99 ms':>8s} {'errors':>6s} {'vs raw':>8s}"
            )
            raw_of = {name: name.split()[0] for name in servers}
            for c in args.concurrency:
                for name, result in measure(servers, args.rounds, args.requests, bodies, c).items():
                    row(name, "/classify", c, result, 1, raw[raw_of[name]][f"predict@{c}"])
            for c in (1, 8):
                for name, result in measure(servers, args.rounds, args.requests // 4, bodies, c, "/explain").items():
                    row(name, "/explain", c, result, 1, raw[raw_of[name]]["explain@1"])
            if multilabel:
                for c in (1, 8):
                    for name, result in measure(
                        servers, args.rounds, args.requests, ml_bodies, c, "/multilabel"
                    ).items():
                        row(name, "/multilabel", c, result, 1, ml_raw[raw_of[name]][f"predict@{c}"])
            if args.batch_images:
                B = args.batch_images
                on = {name: server for name, server in servers.items() if name.endswith("on")}  # no batching used
                results = measure(
                    on or servers,
                    args.rounds,
                    max(args.requests // B, args.rounds),
                    bodies,
                    1,
                    "/classify_batch?top_k=1",
                    batch=B,
                )
                for name, result in results.items():
                    row(name, f"/classify_batch {B}", 1, result, B, raw[raw_of[name]][f"predict@{B}"])
            for name, server in servers.items():
                if name.endswith("on") and args.rss_requests:
                    rss = [server.rss_mib()]
                    step = max(args.rss_requests // 10, 1)
                    total_errors: dict[str, int] = {}
                    for _ in range(0, args.rss_requests, step):
                        _, _, errors = asyncio.run(load(server.url, bodies, step, 32))
                        for k, v in errors.items():
                            total_errors[k] = total_errors.get(k, 0) + v
                        rss.append(server.rss_mib())
                    print(
                        f"\n{name}: resident memory over {args.rss_requests} requests (concurrency 32): start "
                        f"{rss[0]:.0f} MiB, end {rss[-1]:.0f} MiB, max {max(rss):.0f} MiB, drift "
                        f"{rss[-1] / rss[0] - 1:+.1%}, errors {total_errors or 0}"
                    )
                    print("  per step: " + " ".join(f"{r:.0f}" for r in rss), flush=True)
        finally:
            for server in servers.values():
                server.stop()


if __name__ == "__main__":
    main()
