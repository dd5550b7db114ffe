"""Adaptive batching of single-image requests: the runtime the batches run on (the cores split between them), BentoML's
batching engine around it (``Batcher``), lone-request options and the batch-size metric.

The engine is BentoML's own (``CorkDispatcher``). What BentoML 1.4.40 cannot do around it: a batchable API takes
pixel tensors, not uploads, and its in-process client to one loses responses under concurrency (``Batcher``); its
batch-time fit is tilted by one slow batch (``refit_batch_times``); and a batch runs on whatever the API runs,
never a runtime of its own with the cores split (``batch_runtime``)."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from capserve.hardware import available_cores
from capserve.pipeline.inference import Outputs
from capserve.runtime import Runtime, load_runtime
from capserve.serving.settings import Settings

__all__ = [
    "BATCHES_IN_FLIGHT",
    "ENDPOINTS",
    "INLINE_DECODE_BYTES",
    "INLINE_DECODE_PIXELS",
    "SHED_LOG_SECONDS",
    "Batcher",
    "batch_runtime",
    "batch_size_histogram",
    "batches_for",
    "refit_batch_times",
]

log = logging.getLogger("capserve.service")

# An upload at most this large decodes on the event loop under load: a small PNG or JPEG decodes faster than the
# hops to a worker thread and back (docs/benchmarks/serving.md, "HTTP request path"). A larger one decodes in a worker
# thread, beside the event loop.
INLINE_DECODE_BYTES = 64 * 1024


INLINE_DECODE_PIXELS = 64 * 64


BATCHES_IN_FLIGHT = 2  # adaptive batches run at once on a CPU, on the worker's cores split between them (batch_runtime)


SHED_LOG_SECONDS = 10.0  # at most one log line per endpoint this often about requests shed with a 503


ENDPOINTS = {False: "classify", True: "multilabel"}  # multilabel → the endpoint label of the batch-size metric


def batches_for(threads: int) -> int:
    """Adaptive batches run at once on a separate CPU batch session, for a worker with ``threads`` intra-op threads:
    ``BATCHES_IN_FLIGHT``, but never more than its threads (a worker with one core's share runs one at a time, so
    that N workers never run more inference threads than there are cores)."""
    return max(1, min(BATCHES_IN_FLIGHT, threads))


def batch_runtime(runtime: Runtime, settings: Settings) -> Runtime:
    """The runtime adaptive batches run on: on a CPU, the worker's cores (``settings.threads``,
    capserve.serving.workers) split between the batches in flight (``batches_for``; on 2 cores: one intra-op thread
    each), so that the next batch starts while one runs and no run waits on a peer thread descheduled by another,
    which costs less CPU per request than one batch at a time on all the cores (docs/benchmarks/serving.md). For
    ONNX Runtime a second session of the same graph; for torch the same model run on fewer threads
    (``TorchRuntime.with_threads``). Lone requests keep ``runtime`` and all the worker's cores (the lowest latency).
    On a GPU: itself.
    """
    if settings.device != "cpu" or runtime.backend not in ("onnxruntime", "torch"):
        return runtime
    threads = settings.threads or available_cores()
    if runtime.backend == "torch":
        return runtime.with_threads(max(1, threads // batches_for(threads)))  # type: ignore[attr-defined]
    batches = load_runtime(
        runtime.path, "onnxruntime", settings.device, threads=max(1, threads // batches_for(threads))
    )
    batches.familiarity = runtime.familiarity  # the same model: its answers carry the same unfamiliarity
    return batches


def refit_batch_times(optimizer: Any) -> None:
    """Refit a BentoML adaptive-batching ``Optimizer``'s estimates from its recent batches (``o_stat``: images,
    seconds, seconds the first request waited), robustly: per-image time = the median of seconds ÷ images, no fixed
    part, wait = the median wait.

    BentoML fits batch time = a · images + b by least squares and clips b at 0. Its batches are nearly all the same
    size under load, so one slow batch (a paused process, a descheduled thread) tilts the line to seconds per image:
    the estimated wait of a short queue then passes ``CAPSERVE_MAX_LATENCY_MS`` while real waits are well under it,
    and requests are shed with 503s; a large mean wait also keeps batches corked until full. Medians ignore such
    outliers (docs/deploy.md has what it cost in ``benchmarks/bench_http.py``'s table).

    Works around ``Optimizer.trigger_refresh`` (``bentoml._internal.marshal.dispatcher``) of BentoML 1.4.40: once
    upstream fits robustly, the assertion on BentoML's own fit in tests/serving/test_service_paths.py
    (``test_one_slow_batch_does_not_make_adaptive_batching_shed_requests``) fails."""
    if not optimizer.o_stat:
        return
    images, seconds, waits = np.array(optimizer.o_stat, dtype=np.float64).T  # (S,) each
    optimizer.o_a = max(1e-6, float(np.median(seconds / np.maximum(images, 1))))
    optimizer.o_b = 0.0
    optimizer.wait = max(0.0, float(np.median(waits)))


class Batcher:
    """Adaptive batching of one model's single-image requests: ``await batcher(pixels)``, uint8 (1, C, H, W) →
    ``Outputs`` of one image, merged with concurrent requests into batches of up to ``settings.max_batch_size``.

    The batches run on ``runtime`` (``batch_runtime`` of the served one), at most ``in_flight`` at once, each
    through ``infer(runtime, pixels)`` (B, C, H, W) → ``Outputs`` of B images. A request that the engine expects to
    wait longer than ``CAPSERVE_MAX_LATENCY_MS`` is shed: it raises ``shed(message)`` (the server answers 503), and
    the shedding is logged at most once per ``SHED_LOG_SECONDS``.

    The engine is BentoML's (the ``CorkDispatcher`` behind batchable APIs), called in-process: BentoML 1.4.40's
    in-process client to a batchable API (``self.to_async``) loses responses under concurrency (aiohttp "Server
    disconnected"). To tell when that is fixed upstream: route ``/classify`` through ``self.to_async.logits`` and
    run tests/serving/test_service.py's ``test_concurrent_requests_equal_unbatched``.
    """

    def __init__(
        self,
        runtime: Runtime,
        settings: Settings,
        endpoint: str,
        infer: Callable[[Runtime, np.ndarray], Awaitable[Outputs]],
        shed: Callable[[str], Exception],
    ):
        self.runtime = batch_runtime(runtime, settings)
        self.settings, self.endpoint = settings, endpoint
        apart = self.runtime is not runtime  # on a CPU: the worker's threads split between batches
        self.in_flight = batches_for(settings.threads or available_cores()) if apart else 1  # else 1, BentoML's
        self._infer, self._refuse_shed = infer, shed
        self.dispatcher: Any = None  # BentoML's CorkDispatcher, once started
        self._batched: Any = None
        self.shed, self._logged = 0, -float("inf")  # requests shed so far; when that was last logged

    async def __call__(self, pixels: np.ndarray) -> Outputs:
        return await self.start()(pixels)

    def start(self) -> Any:
        """BentoML's engine around this batcher's inference, created once, on first use: its queue binds to the
        event loop that is running then."""
        if self._batched is None:
            from bentoml._internal.marshal.dispatcher import CorkDispatcher, NonBlockSema

            self.dispatcher = CorkDispatcher(
                max_latency_in_ms=self.settings.max_latency_ms,
                max_batch_size=self.settings.max_batch_size,
                fallback=self._overloaded,
                get_batch_size=len,
                batch_dim=(0, 0),
                shared_sema=NonBlockSema(self.in_flight),
            )
            optimizer = self.dispatcher.optimizer
            optimizer.trigger_refresh = functools.partial(refit_batch_times, optimizer)
            self._batched = self.dispatcher(self._run)
        return self._batched

    async def _run(self, batches: list[np.ndarray]) -> list[Outputs]:
        batch_size_histogram().labels(endpoint=self.endpoint).observe(len(batches))
        outputs = await self._infer(self.runtime, np.concatenate(batches))  # B images
        return outputs.split([len(b) for b in batches])

    def _overloaded(self) -> Any:
        # BentoML's dispatcher sheds a request when its estimate of the wait (time queued + recent batch times for
        # the queue ahead) reaches the budget, not only once the request has waited that long
        self.shed += 1
        budget = self.settings.max_latency_ms
        if time.monotonic() - self._logged >= SHED_LOG_SECONDS:  # one line per interval, not per request
            self._logged = time.monotonic()
            optimizer = self.dispatcher.optimizer  # its fit of batch time = a · images + b, from recent batches
            log.warning(
                "/%s: adaptive batching has shed %d request(s) with a 503 so far: its estimate of their wait "
                "reached CAPSERVE_MAX_LATENCY_MS=%d ms (%d more queued; batch time estimated as %.2f ms per "
                "image + %.1f ms)",
                self.endpoint,
                self.shed,
                budget,
                len(getattr(self.dispatcher, "_queue", ())),
                1e3 * optimizer.o_a,
                1e3 * optimizer.o_b,
            )
        raise self._refuse_shed(
            f"the server is overloaded: adaptive batching expects this request to wait over {budget} ms "
            "(CAPSERVE_MAX_LATENCY_MS); retry later",
        )


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
