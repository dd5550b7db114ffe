"""Load on a real server, for capserve's measurements (``capserve tune``, ``benchmarks/bench_http.py``).

``load``: httpx's async client on keep-alive connections, at most ``concurrency`` requests in flight, each client
sending its next request as soon as its last one is answered. ``running_server``: ``bentoml serve`` of capserve's
service with a given environment, ready and then stopped whole (its workers too).

BentoML 1.4.40 ships no load generator; its server is started here as ``capserve serve`` starts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np

from capserve.serving.cli import SERVICE

__all__ = ["load", "random_png", "running_server"]


async def load(
    url: str,
    bodies: list[bytes],
    requests: int,
    concurrency: int,
    endpoint: str = "/classify?top_k=1",
    batch: int = 1,
    seconds: float | None = None,
    field: str | None = None,
) -> tuple[float, np.ndarray, dict[str, int]]:
    """``requests`` POSTs to ``endpoint`` (fewer when ``seconds`` pass first), at most ``concurrency`` in flight:
    (seconds taken, latencies in ms, errors by status or exception name).

    ``batch`` > 1: each request is multipart with ``batch`` images in the field ``images`` (/classify_batch);
    otherwise one PNG, multipart in the field ``field`` where one is named (as a browser's form sends it), else the
    raw body.
    """
    import httpx  # a dependency of BentoML, which the server needs

    latencies: list[float] = []
    errors: dict[str, int] = {}
    next_index = 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        start = time.perf_counter()
        deadline = start + seconds if seconds is not None else float("inf")

        async def worker() -> None:
            nonlocal next_index
            while next_index < requests and time.perf_counter() < deadline:
                i = next_index
                next_index += 1
                t = time.perf_counter()
                try:
                    if batch > 1:
                        files = [
                            ("images", (f"{k}.png", bodies[(i + k) % len(bodies)], "image/png")) for k in range(batch)
                        ]
                        r = await client.post(endpoint, files=files)
                    elif field:
                        r = await client.post(
                            endpoint, files={field: ("image.png", bodies[i % len(bodies)], "image/png")}
                        )
                    else:
                        r = await client.post(
                            endpoint, content=bodies[i % len(bodies)], headers={"content-type": "image/png"}
                        )
                    status = str(r.status_code)
                except httpx.HTTPError as e:
                    status = type(e).__name__
                latencies.append((time.perf_counter() - t) * 1000)
                if status != "200":
                    errors[status] = errors.get(status, 0) + 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - start, np.array(latencies), errors


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def random_png(size: int, seed: int) -> bytes:
    """A seeded noise image, ``size`` pixels a side, as PNG bytes: the load's request bodies."""
    from PIL import Image

    buffer = io.BytesIO()
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


@contextlib.contextmanager
def running_server(env: Mapping[str, str], home: Path, timeout: float = 180) -> Iterator[str]:
    """``bentoml serve`` of capserve's service (the command ``capserve serve`` runs) on 127.0.0.1 with the
    environment ``env``, its log in ``home``; yields its URL once ``/readyz`` answers 200, stops it (SIGTERM, then
    SIGKILL of what is left of it and its workers) afterwards."""
    import httpx
    import psutil

    port = _free_port()
    log_path = home / f"server-{port}.log"
    command = [sys.executable, "-m", "bentoml", "serve", SERVICE, "--host", "127.0.0.1", "--port", str(port)]
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(command, env=dict(env), stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    family: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}: {_tail(log_path)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server was not ready after {timeout:.0f} s: {_tail(log_path)}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                    break
            time.sleep(0.2)
        yield url
    finally:
        with contextlib.suppress(psutil.Error):
            family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)
        for p in family:  # BentoML's workers are process groups of their own: a killed server leaves them
            with contextlib.suppress(psutil.Error):
                p.kill()
        proc.wait()


def _tail(path: Path) -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return " | ".join(lines[-3:])[-600:]
