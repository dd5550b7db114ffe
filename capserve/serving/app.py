"""The request logic of the HTTP service: ``Capsules`` (the served models, loaded once and warmed up, and one method
per endpoint) and ``http_error``, which turns a ``RequestError`` into BentoML's answer with its status; decoding
and answers are ``capserve.pipeline``'s.

``service.py`` is a thin BentoML shell over ``Capsules``. BentoML is imported only inside the functions that need
it (its exception types, its version); adaptive batching is ``capserve.serving.batching``'s, model loading
``capserve.pipeline.models``'s.
"""

from __future__ import annotations

import base64
import functools
import logging
from dataclasses import asdict
from http import HTTPStatus
from typing import Any

import anyio
import numpy as np

from capserve.data.images import ImageTooLargeError
from capserve.data.preprocess import normalize_images
from capserve.errors import ConfigurationError, InputError
from capserve.pipeline.answers import classifications, multilabel_answers, top_labels
from capserve.pipeline.decoding import RequestError, Upload, decode
from capserve.pipeline.explain import Occlusion, heatmap_png, occlusion, occlusion_png, selectivity, vs_uniform
from capserve.pipeline.inference import logits_of
from capserve.pipeline.models import ARTIFACTS, EXPLAIN_ARTIFACT, ModelSource, has_routing, open_model
from capserve.pipeline.schemas import Capsule, Classification, Explained, MultiLabel, Occluded
from capserve.runtime import Explanation, Runtime
from capserve.runtime.outputs import answer_options, softmax
from capserve.serving.batching import (
    ENDPOINTS,
    INLINE_DECODE_BYTES,
    INLINE_DECODE_PIXELS,
    Batcher,
    batch_size_histogram,
)
from capserve.serving.guard import remember_error
from capserve.serving.process import leave_failed_worker, report_failed_start
from capserve.serving.routes import ARRAY_ROUTES, NO_MULTILABEL_MODEL
from capserve.serving.settings import Settings
from capserve.serving.tuned import CHOICES
from capserve.serving.workers import Worker, assign

log = logging.getLogger("capserve.service")


# ---------------------------------------------------------------------------- request errors


_HTTP_ERRORS: dict[int, type] = {}


def http_error(error: RequestError) -> Exception:
    """``error`` as the BentoML exception that makes BentoML answer with its status (its ``error_code``); its
    message is kept for the answer's body (``remember_error``)."""
    from bentoml.exceptions import BentoMLException

    remember_error(str(error))
    if error.status not in _HTTP_ERRORS:
        _HTTP_ERRORS[error.status] = type(
            f"HTTP{error.status}", (BentoMLException,), {"error_code": HTTPStatus(error.status)}
        )
    return _HTTP_ERRORS[error.status](str(error))


# ---------------------------------------------------------------------------- the service's logic


class Capsules:
    """What the service does, for ``service.py`` to expose: the runtimes (loaded once and warmed up), adaptive
    batching of single-image requests, and one method per endpoint. Bad requests raise ``error(RequestError)``
    (``http_error``: BentoML's exceptions, answered with the right status). ``worker`` is this server process's
    share of the machine (``capserve.serving.workers.assign``; default: the only worker, all of it).

    ``input_shapes`` maps each pixel-tensor route to the (C, H, W) its model takes, for ``RequestGuard`` and the
    OpenAPI document."""

    def __init__(self, settings: Settings, error: Any = http_error, worker: Worker | None = None):
        self.error, self.ready = error, False
        try:
            self.worker = worker or assign(settings, 0, 1)
            self.settings = settings = self.worker.settings(settings)  # its device and threads
            self.runtime, self.explainer, self.source = open_model(settings.model, settings)
            self.multilabel_runtime: Runtime | None = None
            self.multilabel_source: ModelSource | None = None
            if settings.multilabel_model.lower() != "none":
                # no explanation graph: /explain serves the single-label model only
                self.multilabel_runtime, _, self.multilabel_source = open_model(
                    settings.multilabel_model, settings, explain=False
                )
                if self.multilabel_runtime.metadata.task != "multi_label":
                    raise ConfigurationError(
                        f"CAPSERVE_MULTILABEL_MODEL={settings.multilabel_model} is a "
                        f"{self.multilabel_runtime.metadata.task} model; give a multi_label "
                        "one or 'none'"
                    )
            runtimes = {False: self.runtime, True: self.multilabel_runtime}  # multilabel → its runtime
            self.batching = settings.max_batch_size > 1
            # multilabel → adaptive batching of its single-image requests (their own ONNX Runtime session on CPUs)
            infer = functools.partial(self.run, self.predict)
            self.batchers = {
                multilabel: Batcher(runtime, settings, ENDPOINTS[multilabel], infer, self.fail)
                for multilabel, runtime in runtimes.items()
                if runtime is not None and self.batching
            }
            self._pending = {False: 0, True: 0}  # multilabel → single-image requests decoding, queued or running
            self._warm_up()
            self.input_shapes = {
                route: tuple(runtimes[multilabel].metadata.input_shape)  # (C, H, W)
                for route, multilabel in ARRAY_ROUTES.items()
                if runtimes[multilabel] is not None
            }
            if settings.api_keys:
                log.info(
                    "API keys: %d; every route but /livez, /readyz, /metrics and /ui needs 'Authorization: Bearer KEY'",
                    len(settings.api_keys),
                )
            else:
                log.warning(
                    "CAPSERVE_API_KEYS is not set: this server is open, every route answers anyone who can "
                    "reach its port"
                )
        except Exception as e:  # any failed start stops the server (exit 3); unexpected ones with their traceback
            log.critical("capserve cannot start: %s", e, exc_info=not isinstance(e, ConfigurationError))
            if report_failed_start() and isinstance(e, ConfigurationError):
                # a server's worker: its server stops with status 3, and leaving here spares the log BentoML's
                # tracebacks of what the line above already said (leave_failed_worker)
                leave_failed_worker()
            raise

    def _warm_up(self) -> None:
        """One inference per loaded runtime (and explanation graph): readiness means a real answer came back."""
        try:
            served = (self.runtime, self.multilabel_runtime, self.explainer)
            others = [batcher.runtime for batcher in self.batchers.values()]
            batch_sessions = [r for r in others if all(r is not s for s in served)]
            for runtime in (*served, *batch_sessions):
                if runtime is None:
                    continue
                zeros = normalize_images(np.zeros((1, *runtime.metadata.input_shape), np.uint8), runtime.metadata)
                logits = runtime.predict(zeros)
                if logits.shape != (1, len(runtime.metadata.labels)) or not np.isfinite(logits).all():
                    raise ConfigurationError(
                        f"warm-up inference of {runtime.metadata.name} gave {logits.shape} "
                        "logits with non-finite values or the wrong shape"
                    )
                if runtime is self.explainer:
                    runtime.explain(zeros)
            for runtime in (batcher.runtime for batcher in self.batchers.values()):
                if runtime.backend == "torch" and self.settings.device == "cpu":
                    # a full batch, so that big routing steps compile their fused kernel (capserve.routing; once per
                    # shape) during start-up rather than in the first busy moment's requests
                    full = np.zeros((self.settings.max_batch_size, *runtime.metadata.input_shape), np.uint8)
                    runtime.predict(normalize_images(full, runtime.metadata))
        except (InputError, NotImplementedError, RuntimeError, AssertionError) as e:
            raise ConfigurationError(f"warm-up inference failed: {e}") from e
        self.ready = True
        log.info(
            "capserve ready: %s (%s %s on %s, providers %s), batching %s",
            self.runtime.metadata.name,
            self.settings.backend,
            self.runtime.precision,
            self.settings.device,
            self.runtime.providers,
            f"up to {self.settings.max_batch_size}" if self.batching else "off",
        )

    def fail(self, status: int, message: str) -> Exception:
        return self.error(RequestError(status, message))

    def predict(self, runtime: Runtime, pixels: np.ndarray, batch_size: int | None = None) -> np.ndarray:
        """uint8 (B, C, H, W) → float32 logits (B, classes), ``batch_size`` images at a time (default all); bad
        pixels or shapes are 400s."""
        try:
            return logits_of(runtime, pixels, batch_size)
        except RequestError as e:
            raise self.error(e) from e

    async def run(self, function: Any, *args: Any) -> Any:
        """``function(*args)`` in a worker thread; its RequestErrors become ``error``'s exceptions."""
        try:
            return await anyio.to_thread.run_sync(function, *args)
        except RequestError as e:
            raise self.error(e) from e

    def multilabel_model(self) -> Runtime:
        if self.multilabel_runtime is None:
            raise self.fail(501, NO_MULTILABEL_MODEL)
        return self.multilabel_runtime

    async def logits(self, pixels: np.ndarray, multilabel: bool = False) -> np.ndarray:
        """Logits (B, classes) for uint8 pixels (B, C, H, W), without adaptive batching (the batchable APIs)."""
        runtime = self.multilabel_model() if multilabel else self.runtime
        return await self.run(self.predict, runtime, pixels)

    async def upload_logits(self, image: Upload, multilabel: bool = False) -> np.ndarray:
        """Logits (1, classes) of one uploaded image, the server picking by load: when no other single-image
        request is in progress, decoding and inference run in one worker-thread hop (batching would only wait);
        otherwise the decoded image joins adaptive batching (when it is on). Answers are the same either way."""
        runtime = self.multilabel_model() if multilabel else self.runtime
        max_pixels = self.settings.max_pixels

        def decode_and_predict() -> np.ndarray:
            pixels = decode(image, runtime, max_pixels)[None]  # (1, C, H, W)
            return self.predict(runtime, pixels)  # (1, classes)

        self._pending[multilabel] += 1
        try:
            if not self.batching:
                return await self.run(decode_and_predict)
            if self._pending[multilabel] == 1:
                batch_size_histogram().labels(endpoint=ENDPOINTS[multilabel]).observe(1)
                return await self.run(decode_and_predict)
            pixels = self.decode_small(image, runtime)
            if pixels is None:
                pixels = await self.run(decode, image, runtime, max_pixels)
            return await self.batchers[multilabel](pixels[None])
        finally:
            self._pending[multilabel] -= 1

    def decode_small(self, image: Upload, runtime: Runtime) -> np.ndarray | None:
        """``image`` decoded right here, on the event loop, when it is small (``INLINE_DECODE_BYTES``,
        ``INLINE_DECODE_PIXELS``); None when it is larger: a worker thread decodes it. Bad images raise as
        ``decode`` does."""
        if not isinstance(image, bytes) or len(image) > INLINE_DECODE_BYTES:
            return None
        try:
            return decode(image, runtime, min(self.settings.max_pixels, INLINE_DECODE_PIXELS))
        except RequestError as e:
            if isinstance(e.__cause__, ImageTooLargeError):
                return None  # only too large to decode here: a worker thread checks it against the real limit
            raise self.error(e) from e

    def options(
        self, runtime: Runtime, top_k: int | None = None, threshold: float | None = None, multi_label: bool = False
    ) -> tuple[int, float | None]:
        """A request's ``top_k`` and ``threshold`` for ``runtime``'s model (``answer_options``); out of range: 400."""
        try:
            return answer_options(len(runtime.metadata.labels), top_k, threshold, multi_label)
        except ValueError as e:
            raise self.fail(400, str(e)) from e

    async def classify(self, image: Upload, top_k: int | None = None) -> Classification:
        meta = self.runtime.metadata
        top_k, _ = self.options(self.runtime, top_k)
        return classifications(await self.upload_logits(image), meta, top_k)[0]

    async def classify_batch(self, files: list[Upload], top_k: int | None = None) -> list[Classification]:
        meta, settings = self.runtime.metadata, self.settings
        if not files:
            raise self.fail(400, "send at least one image in the multipart field 'images'")
        if len(files) > settings.max_images:
            raise self.fail(
                413, f"{len(files)} images in one request; the limit is {settings.max_images} (CAPSERVE_MAX_IMAGES)"
            )
        top_k, _ = self.options(self.runtime, top_k)

        def run() -> np.ndarray:
            pixels = [decode(path, self.runtime, settings.max_pixels, f"image {i}") for i, path in enumerate(files)]
            return self.predict(self.runtime, np.stack(pixels), batch_size=settings.max_batch_size)  # (B, C, H, W)

        return classifications(await self.run(run), meta, top_k)

    async def multilabel(self, image: Upload, threshold: float | None) -> MultiLabel:
        runtime = self.multilabel_model()
        meta = runtime.metadata
        _, threshold = self.options(runtime, threshold=threshold, multi_label=True)
        return multilabel_answers(await self.upload_logits(image, multilabel=True), meta, threshold)[0]

    async def explain(self, image: Upload, capsules: int) -> Explained:
        explainer = self.explainer
        if not has_routing(self.runtime):
            raise self.fail(
                501,
                f"{self.runtime.metadata.name} is a CNN without routing: there is no part-whole "
                "parse to explain; /explain needs a capsule network",
            )
        if explainer is None:
            model = self.source.path
            if not model.is_dir():  # one graph file: the export and the torch backend need the model folder
                raise self.fail(
                    501,
                    f"{self.settings.model} is one graph file, without {EXPLAIN_ARTIFACT}: serve the model folder "
                    f"it was exported from, after `capserve export onnx FOLDER -o FOLDER/{EXPLAIN_ARTIFACT} "
                    "--explain`, or that folder with CAPSERVE_BACKEND=torch",
                )
            raise self.fail(
                501,
                f"{self.settings.model} has no {EXPLAIN_ARTIFACT}: run `capserve export onnx "
                f"{model} -o {model / EXPLAIN_ARTIFACT} --explain` or serve with "
                "CAPSERVE_BACKEND=torch",
            )
        meta = explainer.metadata
        pixels = await self.run(decode, image, explainer, self.settings.max_pixels)

        def run() -> Explanation:
            x = normalize_images(pixels[None], meta)
            return explainer.explain(x)

        def occlude() -> Occlusion:  # every occluded copy in one call, split into the server's batches
            def logits_of(copies: np.ndarray) -> np.ndarray:
                return self.predict(self.runtime, copies, batch_size=self.settings.max_batch_size)

            return occlusion(pixels, np.asarray(self.runtime.metadata.mean), logits_of)

        explanation = await self.run(run)
        occluded = await self.run(occlude)
        probabilities = softmax(explanation.logits)[0]  # (C,)
        c = int(probabilities.argmax())
        C = len(meta.labels)
        routing = explanation.part_whole[0, c]  # (H, W, I)
        _, W, I = routing.shape
        order = np.argsort(-routing.reshape(-1), kind="stable")[: min(capsules, routing.size)]
        top = [
            Capsule(
                type=int(k % I),
                row=int(k // (W * I)),
                col=int(k // I % W),
                routing_probability=float(routing.flat[k]),
                vs_uniform=float(routing.flat[k] * C),
            )
            for k in order
        ]
        grid = routing.mean(axis=-1)  # (H, W)
        png = await self.run(heatmap_png, pixels, vs_uniform(grid, C))
        occlusion_map = await self.run(occlusion_png, pixels, occluded)
        return Explained(
            model=meta.name,
            iterations=meta.iterations,
            prediction=top_labels(probabilities, meta.labels, 1)[0],
            uniform=1.0 / C,
            selectivity=selectivity(explanation.part_whole[0]),
            grid=grid.tolist(),
            capsules=top,
            heatmap_png=base64.b64encode(png).decode(),
            occlusion=Occluded(
                probability=occluded.probability,
                log_odds=occluded.log_odds,
                window=occluded.patch,
                starts=occluded.starts,
                probabilities=occluded.probabilities.tolist(),
                drop=occluded.drop.tolist(),
                forward_passes=occluded.forward_passes,
                heatmap_png=base64.b64encode(occlusion_map).decode(),
            ),
        )

    def describe(self) -> dict[str, Any]:
        """GET /model: the served models (with their store tags), batching, limits, versions."""

        def model(runtime: Runtime | None, source: ModelSource | None) -> dict[str, Any] | None:
            if runtime is None:
                return None
            # the model-store tag but not the folder it came from: a caller has no business with the host's paths
            return {
                **asdict(runtime.metadata),
                "input_shape": list(runtime.metadata.input_shape),
                "backend": runtime.backend,
                "providers": list(runtime.providers),
                "precision": runtime.precision,
                "precision_reason": runtime.precision_reason,
                "tag": source.tag if source else None,
            }

        import bentoml

        s = self.settings
        return {
            "worker": self.worker.index,
            "workers": self.worker.count,
            "device": self.worker.device,
            "threads": self.worker.threads,
            "lone_request_threads": self.worker.threads,
            "ui": s.ui,
            "single_label": model(self.runtime, self.source),
            "multi_label": model(self.multilabel_runtime, self.multilabel_source),
            "explain": model(self.explainer, self.source),
            "batching": {
                "enabled": self.batching,
                "max_batch_size": s.max_batch_size,
                "max_latency_ms": s.max_latency_ms,
                "batches_in_flight": self.batchers[False].in_flight if self.batching else 0,
            },
            "limits": {"max_bytes": s.max_bytes, "max_pixels": s.max_pixels, "max_images": s.max_images},
            "versions": {"capserve": self.runtime.metadata.capserve_version, "bentoml": bentoml.__version__},
            "choices": self.choices(),
        }

    def choices(self) -> dict[str, dict[str, Any]]:
        """Each choice a tuned file may make (capserve.serving.tuned), its value in use and what set it:
        ``CAPSERVE_<NAME>``, ``tuned (FILE NAME, CPU)`` or ``default`` (no host path: callers see this)."""
        s = self.settings
        values = {
            "backend": self.runtime.backend,
            "precision": self.runtime.precision,
            "artifact": s.artifact or ARTIFACTS.get(s.backend),
            "workers": self.worker.count,
            "threads": self.worker.threads,
            "max_batch_size": s.max_batch_size,
        }
        return {name: {"value": values[name], "set_by": s.sources.get(name, "default")} for name in CHOICES}
