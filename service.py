"""capserve over HTTP: single- and multi-label capsule predictions, with the part-whole parse routing produced.

Run from the repository root: ``bentoml serve service:CapsuleService`` (or ``make serve``). Settings come from
environment variables (see ``capserve.serving.Settings`` and README "Serving over HTTP"); the defaults serve
``models/cifar10`` and ``models/multimnist`` with ONNX Runtime on the CPU. Everything that needs no BentoML
(settings, model loading, the request guard, result maths) lives in ``capserve.serving``.

Endpoints: ``POST /classify``, ``/classify_batch``, ``/multilabel``, ``/explain`` (one image as a multipart
file, or a raw ``image/*`` body with the other parameters in the query string), ``GET /model``, and the batchable
``POST /logits`` and ``/multilabel_logits`` (uint8 images as JSON tensors). Concurrent single-image requests are
merged by BentoML's adaptive batching engine.
"""

from __future__ import annotations

import base64
import logging
import os
import signal
from dataclasses import asdict
from http import HTTPStatus
from pathlib import Path
from typing import Annotated, Any

import anyio
import bentoml
import numpy as np
from bentoml.exceptions import BentoMLException, InvalidArgument
from bentoml.validators import ContentType
from pydantic import BaseModel, Field

from capserve import images
from capserve.runtime import Explanation, InputError, Runtime
from capserve.serving import (
    EXPLAIN_ARTIFACT,
    ConfigurationError,
    RequestGuard,
    Settings,
    heatmap_png,
    open_model,
    sigmoid,
    softmax,
)

log = logging.getLogger("capserve.service")

ImageFile = Annotated[Path, ContentType("image/*")]


SETTINGS = Settings.from_env()  # read once at import: the batching limits go into the API decorators
BATCH_LIMIT = max(SETTINGS.max_batch_size, 2)  # BentoML's batchable APIs want > 1


# ---------------------------------------------------------------------------------------------------- errors


class PayloadTooLarge(InvalidArgument):
    error_code = HTTPStatus.REQUEST_ENTITY_TOO_LARGE


class UnsupportedMediaType(InvalidArgument):
    error_code = HTTPStatus.UNSUPPORTED_MEDIA_TYPE


class Unprocessable(InvalidArgument):
    error_code = HTTPStatus.UNPROCESSABLE_ENTITY


class Overloaded(BentoMLException):
    error_code = HTTPStatus.SERVICE_UNAVAILABLE


class NotAvailable(BentoMLException):
    """An endpoint whose model or artifact this server was started without."""

    error_code = HTTPStatus.NOT_IMPLEMENTED


IMAGE_ERRORS: dict[type[images.ImageError], type[InvalidArgument]] = {
    images.ImageTooLargeError: PayloadTooLarge,
    images.ImageTooSmallError: Unprocessable,
    images.UnsupportedImageError: Unprocessable,
}


def decode(path: Path, runtime: Runtime, max_pixels: int, what: str = "the image") -> np.ndarray:
    """An uploaded file → uint8 (C, H, W) for ``runtime``'s model; bad images raise a 4xx BentoML error.

    ``what`` names the upload in messages (BentoML stores uploads under temporary names the client never saw).
    """
    try:
        return images.load_image(path.read_bytes(), runtime.metadata, max_pixels)
    except images.ImageError as e:
        raise IMAGE_ERRORS.get(type(e), InvalidArgument)(f"{what}: {e}") from e


# ---------------------------------------------------------------------------------------------------- results


class Label(BaseModel):
    label: str
    index: int
    probability: float


class Classification(BaseModel):
    model: str
    iterations: int
    predictions: list[Label] = Field(description="the top_k labels, most probable first")


class MultiLabel(BaseModel):
    model: str
    iterations: int
    threshold: float | None = Field(description="the threshold the request set; None: the model's own thresholds")
    labels: list[Label] = Field(description="every label whose probability passed its threshold, most probable first")
    probabilities: dict[str, float]
    thresholds: dict[str, float]


class Capsule(BaseModel):
    type: int = Field(description="capsule type (channel) in the last grid capsule layer")
    row: int
    col: int
    strength: float = Field(description="routing probability from this capsule to the class, in [0, 1]")


class Explained(BaseModel):
    model: str
    iterations: int
    prediction: Label
    grid: list[list[float]] = Field(description="mean routing strength to the class over capsule types, per grid cell")
    capsules: list[Capsule] = Field(description="the most strongly routed capsules, strongest first")
    heatmap_png: str = Field(description="base64 PNG: the grid's strength over the input, blue (low) to red (high)")


def top_labels(probabilities: np.ndarray, labels: tuple[str, ...], k: int) -> list[Label]:
    order = np.argsort(-probabilities, kind="stable")[:k]
    return [Label(label=labels[i], index=int(i), probability=float(probabilities[i])) for i in order]


# ---------------------------------------------------------------------------------------------------- service

BATCH_SIZE = bentoml.metrics.Histogram(
    name="capserve_batch_size",
    documentation="images per adaptive batch run for single-image requests",
    labelnames=["endpoint"],
    buckets=(1, 2, 4, 8, 16, 32, 64, 128),
)


@bentoml.service(
    name="capserve",
    traffic={"timeout": 60},
    workers=1,
    metrics={"enabled": True},
    labels={"project": "capserve"},
)
class CapsuleService:
    """Capsule network predictions; one runtime per model, loaded once and warmed up before /readyz says ready."""

    def __init__(self) -> None:
        self.ready = False
        try:
            self._load()
        except ConfigurationError as e:
            log.critical("capserve cannot start: %s", e)
            # BentoML respawns a worker that fails to start, forever: stop the server instead (its parent process)
            if os.environ.get("CAPSERVE_EXIT_ON_FAILURE", "1") != "0" and os.getppid() > 1:
                os.kill(os.getppid(), signal.SIGTERM)
            raise

    def _load(self) -> None:
        self.runtime, self.explainer = open_model(SETTINGS.model, SETTINGS)
        self.multilabel_runtime: Runtime | None = None
        if SETTINGS.multilabel_model.lower() != "none":
            self.multilabel_runtime, _ = open_model(SETTINGS.multilabel_model, SETTINGS)
            if self.multilabel_runtime.metadata.task != "multi_label":
                raise ConfigurationError(f"CAPSERVE_MULTILABEL_MODEL={SETTINGS.multilabel_model} is a "
                                         f"{self.multilabel_runtime.metadata.task} model; give a multi_label one "
                                         "or 'none'")  # fmt: skip
        self.batching = SETTINGS.max_batch_size > 1
        self._batchers: dict[bool, Any] = {}  # multilabel → batched predict
        try:
            self._warm_up()
        except (InputError, InvalidArgument, RuntimeError) as e:
            raise ConfigurationError(f"warm-up inference failed: {e}") from e

    def _warm_up(self) -> None:
        """One inference per loaded runtime (and explanation graph): readiness means a real answer came back."""
        for runtime in (self.runtime, self.multilabel_runtime, self.explainer):
            if runtime is None:
                continue
            x = np.zeros((1, *runtime.metadata.input_shape), np.uint8)
            logits = self._predict(runtime, x)
            if logits.shape != (1, len(runtime.metadata.labels)) or not np.isfinite(logits).all():
                raise ConfigurationError(f"warm-up inference of {runtime.metadata.name} gave {logits.shape} logits "
                                         "with non-finite values or the wrong shape")  # fmt: skip
        if self.explainer is not None:
            self.explainer.explain(images.normalize_images(np.zeros((1, *self.explainer.metadata.input_shape),
                                                                    np.uint8), self.explainer.metadata))  # fmt: skip
        self.ready = True
        log.info("capserve ready: %s (%s %s on %s, providers %s), batching %s", self.runtime.metadata.name,
                 SETTINGS.backend, self.runtime.precision, SETTINGS.device, self.runtime.providers,
                 f"up to {SETTINGS.max_batch_size}" if self.batching else "off")  # fmt: skip

    def __is_ready__(self) -> bool:
        return self.ready

    @staticmethod
    def _predict(runtime: Runtime, pixels: np.ndarray) -> np.ndarray:
        """uint8 (B, C, H, W) → float32 logits (B, classes); shape errors become 400s."""
        if pixels.dtype != np.uint8:  # JSON tensors arrive as int64
            if pixels.dtype.kind not in "iu" or pixels.size == 0 or pixels.min() < 0 or pixels.max() > 255:
                raise InvalidArgument(f"images must be integer pixels in [0, 255], got {pixels.dtype} values")
            pixels = pixels.astype(np.uint8)
        try:
            return runtime.predict(images.normalize_images(pixels, runtime.metadata))
        except InputError as e:
            raise InvalidArgument(str(e)) from e

    async def _logits(self, pixels: np.ndarray, multilabel: bool = False) -> np.ndarray:
        """Logits (1, classes) for one image (1, C, H, W): through adaptive batching when it is on."""
        runtime = self._multilabel() if multilabel else self.runtime
        if not self.batching:
            return await anyio.to_thread.run_sync(self._predict, runtime, pixels)
        if multilabel not in self._batchers:  # created on first use: the engine binds to the running event loop
            self._batchers[multilabel] = self._batcher(runtime, multilabel)
        return await self._batchers[multilabel](pixels)

    def _batcher(self, runtime: Runtime, multilabel: bool) -> Any:
        """BentoML's adaptive batching engine (the CorkDispatcher behind batchable APIs) around ``runtime``.

        Called in-process: BentoML's own in-process client to a batchable API (``self.to_async``) loses
        responses under concurrency (aiohttp "Server disconnected"), so the endpoints use the engine directly.
        """
        from bentoml._internal.marshal.dispatcher import CorkDispatcher

        def overloaded() -> Any:
            raise Overloaded(f"the batching queue held this request over {SETTINGS.max_latency_ms} ms "
                             "(CAPSERVE_MAX_LATENCY_MS); retry later")  # fmt: skip

        dispatcher = CorkDispatcher(max_latency_in_ms=SETTINGS.max_latency_ms, max_batch_size=SETTINGS.max_batch_size,
                                    fallback=overloaded, get_batch_size=len, batch_dim=(0, 0))  # fmt: skip
        endpoint = "multilabel" if multilabel else "classify"

        async def infer(batches: list[np.ndarray]) -> list[np.ndarray]:
            BATCH_SIZE.labels(endpoint=endpoint).observe(len(batches))
            logits = await anyio.to_thread.run_sync(self._predict, runtime, np.concatenate(batches))  # (B, classes)
            return list(np.split(logits, np.cumsum([len(b) for b in batches])[:-1]))

        return dispatcher(infer)

    def _multilabel(self) -> Runtime:
        if self.multilabel_runtime is None:
            raise NotAvailable("no multi-label model is served: start the server with CAPSERVE_MULTILABEL_MODEL "
                               "set to a multi_label model directory")  # fmt: skip
        return self.multilabel_runtime

    @bentoml.api(batchable=True, max_batch_size=BATCH_LIMIT, max_latency_ms=SETTINGS.max_latency_ms)
    async def logits(self, images: np.ndarray) -> np.ndarray:
        """Logits (B, classes) of the single-label model for uint8 pixels (B, C, H, W) in its input size."""
        return await anyio.to_thread.run_sync(self._predict, self.runtime, images)

    @bentoml.api(batchable=True, max_batch_size=BATCH_LIMIT, max_latency_ms=SETTINGS.max_latency_ms)
    async def multilabel_logits(self, images: np.ndarray) -> np.ndarray:
        """Logits (B, classes) of the multi-label model for uint8 pixels (B, C, H, W) in its input size."""
        return await anyio.to_thread.run_sync(self._predict, self._multilabel(), images)

    @bentoml.api
    async def classify(self, image: ImageFile, top_k: Annotated[int, Field(ge=1, le=1000)] = 5) -> Classification:
        """The top_k labels of one image, with probabilities (softmax over the class capsules' logits)."""
        meta = self.runtime.metadata
        if top_k > len(meta.labels):
            raise Unprocessable(f"top_k={top_k} but the model has {len(meta.labels)} labels")
        pixels = await anyio.to_thread.run_sync(decode, image, self.runtime, SETTINGS.max_pixels)
        probabilities = softmax(await self._logits(pixels[None]))[0]  # (C,)
        return Classification(model=meta.name, iterations=meta.iterations,
                              predictions=top_labels(probabilities, meta.labels, top_k))  # fmt: skip

    @bentoml.api
    async def classify_batch(
        self, images: list[ImageFile], top_k: Annotated[int, Field(ge=1, le=1000)] = 5
    ) -> list[Classification]:
        """One result per image, in order (the images run as one batch)."""
        meta = self.runtime.metadata
        if not images:
            raise InvalidArgument("send at least one image in the multipart field 'images'")
        if len(images) > SETTINGS.max_images:
            raise PayloadTooLarge(f"{len(images)} images in one request; the limit is {SETTINGS.max_images} "
                                  "(CAPSERVE_MAX_IMAGES)")  # fmt: skip
        if top_k > len(meta.labels):
            raise Unprocessable(f"top_k={top_k} but the model has {len(meta.labels)} labels")

        def run() -> np.ndarray:
            pixels = np.stack(
                [decode(path, self.runtime, SETTINGS.max_pixels, f"image {i}") for i, path in enumerate(images)]
            )  # (B, C, H, W)
            step = SETTINGS.max_batch_size
            return np.concatenate(
                [self._predict(self.runtime, pixels[i : i + step]) for i in range(0, len(pixels), step)]
            )

        probabilities = softmax(await anyio.to_thread.run_sync(run))  # (B, C)
        return [Classification(model=meta.name, iterations=meta.iterations,
                               predictions=top_labels(p, meta.labels, top_k)) for p in probabilities]  # fmt: skip

    @bentoml.api
    async def multilabel(
        self, image: ImageFile, threshold: Annotated[float | None, Field(gt=0, lt=1)] = None
    ) -> MultiLabel:
        """Every label whose probability (sigmoid of its logit) passes its threshold: the model's calibrated
        per-class thresholds (0.5 where it has none), or ``threshold`` for all classes when given."""
        runtime = self._multilabel()
        meta = runtime.metadata
        pixels = await anyio.to_thread.run_sync(decode, image, runtime, SETTINGS.max_pixels)
        probabilities = sigmoid(await self._logits(pixels[None], multilabel=True))[0]  # (C,)
        if threshold is not None:
            thresholds = np.full(len(meta.labels), threshold)
        else:
            thresholds = np.array(meta.thresholds if meta.thresholds is not None else [0.5] * len(meta.labels))
        passed = [label for label in top_labels(probabilities, meta.labels, len(meta.labels))
                  if probabilities[label.index] >= thresholds[label.index]]  # fmt: skip
        return MultiLabel(
            model=meta.name, iterations=meta.iterations, threshold=threshold, labels=passed,
            probabilities={name: float(p) for name, p in zip(meta.labels, probabilities, strict=True)},
            thresholds={name: float(t) for name, t in zip(meta.labels, thresholds, strict=True)},
        )  # fmt: skip

    @bentoml.api
    async def explain(self, image: ImageFile, capsules: Annotated[int, Field(ge=1, le=1000)] = 10) -> Explained:
        """The prediction and its part-whole parse: how strongly each capsule of the last grid layer (type, row,
        column) routed to the predicted class capsule, as the top ``capsules`` entries, a grid of mean strength
        per cell, and that grid as a PNG heat-map over the input."""
        if self.explainer is None:
            raise NotAvailable(f"{SETTINGS.model} has no {EXPLAIN_ARTIFACT}: run `capserve export onnx "
                               f"{SETTINGS.model} -o {Path(SETTINGS.model) / EXPLAIN_ARTIFACT} --explain` or "
                               "serve with CAPSERVE_BACKEND=torch")  # fmt: skip
        meta = self.explainer.metadata
        pixels = await anyio.to_thread.run_sync(decode, image, self.explainer, SETTINGS.max_pixels)

        def run() -> Explanation:
            return self.explainer.explain(images.normalize_images(pixels[None], meta))  # type: ignore[union-attr]

        explanation = await anyio.to_thread.run_sync(run)
        probabilities = softmax(explanation.logits)[0]  # (C,)
        c = int(probabilities.argmax())
        strengths = explanation.part_whole[0, c]  # (H, W, I)
        _, W, I = strengths.shape
        order = np.argsort(-strengths.reshape(-1), kind="stable")[: min(capsules, strengths.size)]
        top = [Capsule(type=int(k % I), row=int(k // (W * I)), col=int(k // I % W), strength=float(strengths.flat[k]))
               for k in order]  # fmt: skip
        grid = strengths.mean(axis=-1)  # (H, W)
        png = await anyio.to_thread.run_sync(heatmap_png, pixels, grid)
        return Explained(
            model=meta.name, iterations=meta.iterations, prediction=top_labels(probabilities, meta.labels, 1)[0],
            grid=grid.tolist(), capsules=top, heatmap_png=base64.b64encode(png).decode(),
        )  # fmt: skip

    @bentoml.api(route="/model")
    def model(self) -> dict[str, Any]:
        """Metadata of the served models: name, task, labels, input size, backend and providers in use, versions."""

        def describe(runtime: Runtime | None) -> dict[str, Any] | None:
            if runtime is None:
                return None
            return {**asdict(runtime.metadata), "input_shape": list(runtime.metadata.input_shape),
                    "backend": runtime.backend, "providers": list(runtime.providers), "precision": runtime.precision,
                    "precision_reason": runtime.precision_reason}  # fmt: skip

        return {
            "single_label": describe(self.runtime),
            "multi_label": describe(self.multilabel_runtime),
            "explain": describe(self.explainer),
            "batching": {
                "enabled": self.batching,
                "max_batch_size": SETTINGS.max_batch_size,
                "max_latency_ms": SETTINGS.max_latency_ms,
            },
            "limits": {
                "max_bytes": SETTINGS.max_bytes,
                "max_pixels": SETTINGS.max_pixels,
                "max_images": SETTINGS.max_images,
            },
            "versions": {"capserve": self.runtime.metadata.capserve_version, "bentoml": bentoml.__version__},
        }


CapsuleService.add_asgi_middleware(
    RequestGuard,
    max_bytes=SETTINGS.max_bytes,
    file_fields={"/classify": "image", "/classify_batch": "images", "/multilabel": "image", "/explain": "image"},
    get_routes=("/model",),
)
