"""The load generator of capserve's measurements (``capserve tune``, ``benchmarks/bench_http.py``): httpx's async
client on keep-alive connections, at most ``concurrency`` requests in flight, each client sending its next request
as soon as its last one is answered."""

from __future__ import annotations

import asyncio
import time

import numpy as np

__all__ = ["load"]


async def load(
    url: str,
    bodies: list[bytes],
    requests: int,
    concurrency: int,
    endpoint: str = "/classify?top_k=1",
    batch: int = 1,
    seconds: float | None = None,
) -> tuple[float, np.ndarray, dict[str, int]]:
    """``requests`` POSTs to ``endpoint`` (fewer when ``seconds`` pass first), at most ``concurrency`` in flight:
    (seconds taken, latencies in ms, errors by status or exception name).

    ``batch`` > 1: each request is multipart with ``batch`` images in the field ``images`` (/classify_batch);
    otherwise one raw PNG body.
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
