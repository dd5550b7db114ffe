"""The request logic of the HTTP service: ``Capsules`` (the served models, loaded once and warmed up, and one method
per endpoint) and ``http_error``, which turns a ``RequestError`` into BentoML's answer with the status ``STATUSES``
gives its kind; images become answers through ``capserve.pipeline.Answerer``, the composition every caller uses.

``service.py`` is a thin BentoML shell over ``Capsules``. BentoML is imported only inside the functions that need
it (its exception types, its version); adaptive batching is ``capserve.serving.batching``'s, model loading
``capserve.pipeline.models``'s.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import asdict
from http import HTTPStatus
from typing import Any

import anyio
import numpy as np

from capserve.data.preprocess import normalize_images
from capserve.errors import ConfigurationError, InputError
from capserve.pipeline.answerer import Answer, Answerer
from capserve.pipeline.decoding import Upload, decode
from capserve.pipeline.errors import ErrorKind, RequestError
from capserve.pipeline.explain import explained
from capserve.pipeline.inference import outputs_of
from capserve.pipeline.models import ARTIFACTS, EXPLAIN_ARTIFACT, ModelSource, has_routing, open_model, resolve_model
from capserve.pipeline.schemas import Classification, Explained, MultiLabel
from capserve.runtime import Runtime
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

__all__ = ["STATUSES", "Capsules", "http_error"]

log = logging.getLogger("capserve.service")


# ---------------------------------------------------------------------------- request errors


# each kind of refusal → its HTTP status (the README's error table): the one place the service chooses them
STATUSES: dict[ErrorKind, HTTPStatus] = {
    ErrorKind.BAD_INPUT: HTTPStatus.BAD_REQUEST,
    ErrorKind.TOO_LARGE: HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
    ErrorKind.TOO_SMALL: HTTPStatus.UNPROCESSABLE_ENTITY,
    ErrorKind.UNSUPPORTED: HTTPStatus.UNPROCESSABLE_ENTITY,
    ErrorKind.UNAVAILABLE: HTTPStatus.NOT_IMPLEMENTED,
    ErrorKind.BUSY: HTTPStatus.SERVICE_UNAVAILABLE,
}


_HTTP_ERRORS: dict[HTTPStatus, type] = {}


def http_error(error: RequestError) -> Exception:
    """``error`` as the BentoML exception that makes BentoML answer with its kind's status (its ``error_code``);
    its message is kept for the answer's body (``remember_error``)."""
    from bentoml.exceptions import BentoMLException

    remember_error(str(error))
    status = STATUSES[error.kind]
    if status not in _HTTP_ERRORS:
        _HTTP_ERRORS[status] = type(f"HTTP{status.value}", (BentoMLException,), {"error_code": status})
    return _HTTP_ERRORS[status](str(error))


# ---------------------------------------------------------------------------- the service's logic


class Capsules:
    """What the service does, for ``service.py`` to expose: the runtimes (loaded once and warmed up), adaptive
    batching of single-image requests, and one method per endpoint, each answering through the model's
    ``Answerer``. Bad requests raise ``error(RequestError)`` (``http_error``: BentoML's exceptions, answered with
    the right status). ``worker`` is this server process's share of the machine (``capserve.serving.workers.assign``;
    default: the only worker, all of it).

    ``input_shapes`` maps each pixel-tensor route to the (C, H, W) its model takes, for ``RequestGuard`` and the
    OpenAPI document."""

    def __init__(self, settings: Settings, error: Any = http_error, worker: Worker | None = None):
        self.error, self.ready = error, False
        try:
            self.worker = worker or assign(settings, 0, 1)
            self.settings = settings = self.worker.settings(settings)  # its device and threads
            self.runtime, self.explainer, self.source = open_model(settings.model, settings)
            self.multilabel_runtime, self.multilabel_source = self._open_multilabel(settings)
            runtimes = {False: self.runtime, True: self.multilabel_runtime}  # multilabel → its runtime
            # multilabel → the route's answers: /classify's whatever the model's task, /multilabel's
            self.answerers = {
                multilabel: Answerer(runtime, settings.max_pixels, settings.max_batch_size, multi_label=multilabel)
                for multilabel, runtime in runtimes.items()
                if runtime is not None
            }
            self.batching = settings.max_batch_size > 1
            # multilabel → adaptive batching of its single-image requests (their own ONNX Runtime session on CPUs)
            infer = functools.partial(self.run, outputs_of)
            self.batchers = {
                multilabel: Batcher(runtime, settings, ENDPOINTS[multilabel], infer, self.shed)
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

    @staticmethod
    def _open_multilabel(settings: Settings) -> tuple[Runtime | None, ModelSource | None]:
        """The multi-label model's runtime and source; (None, None) when the server is started without one."""
        if settings.multilabel_model.lower() == "none":
            return None, None
        # the graph a tuned file or the start-up measurement chose is the single-label folder's: the multi-label
        # model serves the graph of that name in its own folder where it has one that opens here (an INT8 graph
        # re-checks its decisions on this CPU), else its model.onnx
        folder = resolve_model(settings.multilabel_model).path
        default = dataclasses.replace(settings, artifact=None)
        if settings.artifact and not (folder / settings.artifact).is_file():
            log.info("%s has no %s: serving its %s", folder, settings.artifact, ARTIFACTS[settings.backend])
            settings = default
        # no explanation graph: /explain serves the single-label model only
        try:
            runtime, _, source = open_model(settings.multilabel_model, settings, explain=False)
        except ConfigurationError as e:
            if settings is default:
                raise
            log.warning("serving %s's %s instead: %s", folder, ARTIFACTS[settings.backend], e)
            runtime, _, source = open_model(settings.multilabel_model, default, explain=False)
        if runtime.metadata.task != "multi_label":
            raise ConfigurationError(
                f"CAPSERVE_MULTILABEL_MODEL={settings.multilabel_model} is a "
                f"{runtime.metadata.task} model; give a multi_label one or 'none'"
            )
        return runtime, source

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
            for multilabel, batcher in self.batchers.items():
                # a full batch on the batches' threads and on the lone requests' (/classify_batch), so that big routing
                # steps compile their fused kernel (capserve.routing; once per shape and thread count) during
                # start-up rather than in the first busy moment's requests
                lone = self.multilabel_runtime if multilabel else self.runtime
                for runtime in dict.fromkeys((batcher.runtime, lone)):  # each once
                    if runtime.backend == "torch" and self.settings.device == "cpu":
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

    def refuse(self, kind: ErrorKind, message: str) -> Exception:
        """The exception that answers this request as refused for ``kind`` (``error``)."""
        return self.error(RequestError(kind, message))

    def shed(self, message: str) -> Exception:
        """``Batcher``'s refusal of a request it sheds under load."""
        return self.refuse(ErrorKind.BUSY, message)

    def here(self, function: Any, *args: Any) -> Any:
        """``function(*args)`` on the event loop; its RequestErrors become ``error``'s exceptions."""
        try:
            return function(*args)
        except RequestError as e:
            raise self.error(e) from e

    async def run(self, function: Any, *args: Any) -> Any:
        """``function(*args)`` in a worker thread; its RequestErrors become ``error``'s exceptions."""
        try:
            return await anyio.to_thread.run_sync(function, *args)
        except RequestError as e:
            raise self.error(e) from e

    def answerer(self, multilabel: bool = False) -> Answerer:
        """The route's ``Answerer``; the multi-label one when the server has none: 501."""
        if multilabel not in self.answerers:
            raise self.refuse(ErrorKind.UNAVAILABLE, NO_MULTILABEL_MODEL)
        return self.answerers[multilabel]

    async def logits(self, pixels: np.ndarray, multilabel: bool = False) -> np.ndarray:
        """Logits (B, classes) for uint8 pixels (B, C, H, W), without adaptive batching (the batchable APIs)."""
        return await self.run(self.answerer(multilabel).logits, pixels)

    async def answer_one(
        self, image: Upload, multilabel: bool = False, top_k: int | None = None, threshold: float | None = None
    ) -> Answer:
        """The answer for one uploaded image, the server picking by load: when no other single-image request is
        in progress, the answerer's ``answer`` runs in one worker-thread hop (batching would only wait); otherwise
        the decoded image joins adaptive batching (when it is on). Answers are the same either way."""
        answerer = self.answerer(multilabel)
        top_k, threshold = self.here(answerer.options, top_k, threshold)
        self._pending[multilabel] += 1
        try:
            if self.batching and self._pending[multilabel] > 1:
                pixels = self.decode_small(answerer, image)
                if pixels is None:
                    pixels = await self.run(answerer.decode, image)
                outputs = await self.batchers[multilabel](pixels[None])  # one image's
                return answerer.answers(outputs, top_k, threshold)[0]
            if self.batching:
                batch_size_histogram().labels(endpoint=ENDPOINTS[multilabel]).observe(1)
            (answer,) = await self.run(answerer.answer, [image], top_k, threshold)
            if isinstance(answer, RequestError):
                raise self.error(answer)
            return answer
        finally:
            self._pending[multilabel] -= 1

    def decode_small(self, answerer: Answerer, image: Upload) -> np.ndarray | None:
        """``image`` decoded right here, on the event loop, when it is small (``INLINE_DECODE_BYTES``,
        ``INLINE_DECODE_PIXELS``); None when it is larger: a worker thread decodes it. Bad images raise as
        ``decode`` does."""
        if not isinstance(image, bytes) or len(image) > INLINE_DECODE_BYTES:
            return None
        try:
            return answerer.decode(image, max_pixels=min(self.settings.max_pixels, INLINE_DECODE_PIXELS))
        except RequestError as e:
            if e.kind is ErrorKind.TOO_LARGE:
                return None  # only too large to decode here: a worker thread checks it against the real limit
            raise self.error(e) from e

    async def classify(self, image: Upload, top_k: int | None = None) -> Classification:
        return await self.answer_one(image, top_k=top_k)

    async def classify_batch(self, files: list[Upload], top_k: int | None = None) -> list[Classification]:
        if not files:
            raise self.refuse(ErrorKind.BAD_INPUT, "send at least one image in the multipart field 'images'")
        if len(files) > self.settings.max_images:
            raise self.refuse(
                ErrorKind.TOO_LARGE,
                f"{len(files)} images in one request; the limit is {self.settings.max_images} (CAPSERVE_MAX_IMAGES)",
            )
        # one request: the first bad image refuses it whole, named by its position
        return await self.run(self.answerer().answer, files, top_k, None, True)

    async def multilabel(self, image: Upload, threshold: float | None) -> MultiLabel:
        return await self.answer_one(image, multilabel=True, threshold=threshold)

    def served_explainer(self) -> Runtime:
        """The runtime /explain runs on; 501 when the model has no routing or no explanation graph."""
        if not has_routing(self.runtime):
            raise self.refuse(
                ErrorKind.UNAVAILABLE,
                f"{self.runtime.metadata.name} is a CNN without routing: there is no part-whole "
                "parse to explain; /explain needs a capsule network",
            )
        if self.explainer is not None:
            return self.explainer
        model = self.source.path
        if not model.is_dir():  # one graph file: the export and the torch backend need the model folder
            raise self.refuse(
                ErrorKind.UNAVAILABLE,
                f"{self.settings.model} is one graph file, without {EXPLAIN_ARTIFACT}: serve the model folder "
                f"it was exported from, after `capserve export onnx FOLDER -o FOLDER/{EXPLAIN_ARTIFACT} "
                "--explain`, or that folder with CAPSERVE_BACKEND=torch",
            )
        raise self.refuse(
            ErrorKind.UNAVAILABLE,
            f"{self.settings.model} has no {EXPLAIN_ARTIFACT}: run `capserve export onnx "
            f"{model} -o {model / EXPLAIN_ARTIFACT} --explain` or serve with "
            "CAPSERVE_BACKEND=torch",
        )

    async def explain(self, image: Upload, capsules: int) -> Explained:
        explainer = self.served_explainer()
        pixels = await self.run(decode, image, explainer, self.settings.max_pixels)
        served = self.answerer()

        def logits(copies: np.ndarray) -> np.ndarray:  # every occluded copy in one call, in the server's batches
            return served.logits(copies, self.settings.max_batch_size)

        def answer() -> Explained:  # the served model says how familiar the image is, as /classify does
            return explained(pixels, explainer, logits, capsules, served.outputs(pixels[None]).unfamiliarity)

        return await self.run(answer)

    def describe(self) -> dict[str, Any]:
        """GET /model: the served models (with their store tags), batching, limits, versions."""

        def unfamiliarity(runtime: Runtime) -> str:
            if not self.settings.unfamiliar:
                return "off (CAPSERVE_UNFAMILIAR=0)"
            if runtime.familiarity is None:
                return "none: the model folder has no calibration (capserve familiarity MODEL --data DATA)"
            f = runtime.familiarity.fitted
            return (
                f"calibrated on {f.get('train_images')} training and {f.get('validation_images')} validation images, "
                f"{100 * f.get('familiar_share', 0):.0f} % of them familiar"
            )

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
                "unfamiliarity": unfamiliarity(runtime),
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
