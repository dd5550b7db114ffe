"""Adaptive batching: the ONNX Runtime session the batches run on, lone-request options, the batch-size metric."""

from __future__ import annotations

from typing import Any

import numpy as np

from capserve.runtime import Runtime, load_runtime
from capserve.serving.settings import Settings
from capserve.serving.workers import Worker, available_cores

# An upload at most this large decodes on the event loop under load (≈ 0.05–0.15 ms for a 32×32 to 64×64 PNG or
# JPEG), saving the hops to a worker thread and back: +10 % req/s on /multilabel at concurrency 32
# (docs/benchmarks.md). A larger one decodes in a worker thread, beside the event loop.
INLINE_DECODE_BYTES = 64 * 1024


INLINE_DECODE_PIXELS = 64 * 64


BATCHES_IN_FLIGHT = 2  # adaptive batches run at once on a separate ONNX Runtime CPU session (batch_runtime)


def lone_request_options(settings: Settings) -> dict[str, Any]:
    """Options of the session that serves predictions. With adaptive batching on a CPU, ONNX Runtime batches run on
    their own session (``batch_runtime``) and this one mostly runs lone requests, one at a time: its threads may spin
    between an operator's parallel sections instead of sleeping and waking (ONNX Runtime's default, which every
    other session here turns off). Measured with ``benchmarks/bench_http.py --table-only`` (4 interleaved rounds,
    quiet 2-core machine): concurrency-1 p50 10.6 → 9.7 ms on ``/classify`` and 5.5 → 4.5 ms on ``/multilabel``,
    throughput at concurrency 32 and CPU per request unchanged. With batching off, concurrent requests share this
    session, and spinning threads would take the cores their peers need."""
    if settings.backend != "onnxruntime":
        return {}
    threads = {"threads": settings.threads} if settings.threads else {}  # the worker's share (None: all cores)
    batches_apart = settings.device == "cpu" and settings.max_batch_size > 1
    return {**threads, "spinning": True} if batches_apart else threads


def batches_for(threads: int) -> int:
    """Adaptive batches run at once on a separate CPU batch session, for a worker with ``threads`` intra-op threads:
    ``BATCHES_IN_FLIGHT``, but never more than its threads (a worker with one core's share runs one at a time, so
    that N workers never run more inference threads than there are cores)."""
    return max(1, min(BATCHES_IN_FLIGHT, threads))


def batch_runtime(runtime: Runtime, settings: Settings) -> Runtime:
    """The runtime adaptive batches run on: for ONNX Runtime on a CPU, a second session of the same graph with the
    worker's cores (``settings.threads``, capserve.serving.workers) split between the batches in flight
    (``batches_for``; on 2 cores: one intra-op thread each), so that the next batch starts while one runs and
    no run waits on a peer thread descheduled by another; measured on a 2-core machine at concurrency 32,
    ≈ 10 % less CPU per request than one batch at a time on both cores (docs/benchmarks.md). Lone requests
    keep ``runtime`` and all the worker's cores (the lowest latency). Other backends: itself.
    """
    if runtime.backend != "onnxruntime" or settings.device != "cpu":
        return runtime
    threads = settings.threads or available_cores()
    return load_runtime(runtime.path, "onnxruntime", settings.device, threads=max(1, threads // batches_for(threads)))


def borrowing_runtime(runtime: Runtime, settings: Settings, worker: Worker) -> Runtime | None:
    """The session a lone request runs on when its worker has borrowed the other workers' idle cores
    (capserve.serving.cores): the same ONNX Runtime graph on every worker's threads together (so never more than
    the server's), spinning like the lone-request session. None for other backends: torch's threads are set for
    the whole process, and TensorRT serves on GPUs."""
    if runtime.backend != "onnxruntime" or settings.device != "cpu":
        return None
    options = {**lone_request_options(settings), "threads": worker.threads * worker.count}
    return load_runtime(runtime.path, "onnxruntime", settings.device, **options)


def refit_batch_times(optimizer: Any) -> None:
    """Refit a BentoML adaptive-batching ``Optimizer``'s estimates from its recent batches (``o_stat``: images,
    seconds, seconds the first request waited), robustly: per-image time = the median of seconds ÷ images, no fixed
    part, wait = the median wait.

    BentoML fits batch time = a · images + b by least squares and clips b at 0. Its batches are nearly all the same
    size under load, so one slow batch (a paused process, a descheduled thread) tilts the line: measured in
    ``benchmarks/bench_http.py``'s table, a went from 4 ms to 134–895 ms per image, the estimated wait of a queue of
    a dozen requests passed ``CAPSERVE_MAX_LATENCY_MS`` (10 s) while real waits were 0.1–0.4 s, and requests were
    shed with 503s; a large mean wait also kept batches corked until full. Medians ignore such outliers."""
    if not optimizer.o_stat:
        return
    images, seconds, waits = np.array(optimizer.o_stat, dtype=np.float64).T  # (S,) each
    optimizer.o_a = max(1e-6, float(np.median(seconds / np.maximum(images, 1))))
    optimizer.o_b = 0.0
    optimizer.wait = max(0.0, float(np.median(waits)))


ENDPOINTS = {False: "classify", True: "multilabel"}  # multilabel → the endpoint label of the batch-size metric


_BATCH_SIZE: list[Any] = []


def batch_size_histogram() -> Any:
    """BentoML's Prometheus histogram of adaptive batch sizes (created once, on first use)."""
    if not _BATCH_SIZE:
        import bentoml

        _BATCH_SIZE.append(
            bentoml.metrics.Histogram(
                name="capserve_batch_size",
                documentation="images per adaptive batch run for single-image requests",
                labelnames=["endpoint"],
                buckets=(1, 2, 4, 8, 16, 32, 64, 128),
            )
        )
    return _BATCH_SIZE[0]
