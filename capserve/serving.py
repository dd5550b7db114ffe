"""Everything the HTTP service does, as plain Python: settings, model loading (directories or BentoML's model
store), the request logic and its results, the ASGI request guard, the server process's start-up rules.

``service.py`` is a thin BentoML shell over ``Capsules``. BentoML is imported only inside the functions that
need it (the model store, the adaptive batching engine, its exception types, its metrics folder).
"""

from __future__ import annotations

import atexit
import base64
import gc
import io
import json
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import asdict, dataclass
from http import HTTPStatus
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import parse_qsl

import anyio
import numpy as np
from pydantic import BaseModel, Field, WrapValidator

from capserve import images
from capserve.runtime import Explanation, InputError, Runtime, RuntimeLoadError, load_runtime
from capserve.runtime.precision import MIN_AGREEMENT, PRECISIONS, PrecisionError, open_torch, resolve_precision

log = logging.getLogger("capserve.service")

BACKENDS = ("onnxruntime", "torch", "tensorrt")


# ---------------------------------------------------------------------------------------------------- settings


class ConfigurationError(ValueError):
    """A setting or model directory the service cannot start with; the message says what to change."""


def _int(env: Mapping[str, str], name: str, default: int | None, minimum: int) -> int | None:
    text = env.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ConfigurationError(f"{name}={text!r} is not an integer") from None
    if value < minimum:
        raise ConfigurationError(f"{name}={value} must be >= {minimum}")
    return value


@dataclass(frozen=True)
class Settings:
    """Service settings, each from the environment variable ``CAPSERVE_<FIELD>``."""

    model: str = "models/cifar10"  # single-label model directory (/classify, /classify_batch, /explain)
    multilabel_model: str = "models/multimnist"  # multi-label model directory (/multilabel); "none": no endpoint
    backend: str = "onnxruntime"  # onnxruntime | torch | tensorrt
    device: str = "cpu"  # cpu | cuda | cuda:N
    iterations: int | None = None  # torch backend only: routing iterations (ONNX/TensorRT fix T at export)
    precision: str = "auto"  # fp32 | bf16 (torch backend) | auto: bf16 where the CPU has native bf16 and torch serves
    bf16_min_agreement: float = MIN_AGREEMENT  # bf16 start-up check: least agreement with fp32, else fp32 is served
    max_batch_size: int = 32  # adaptive batching: largest merged batch; 1 turns batching off
    max_latency_ms: int = 10_000  # adaptive batching: a request queued longer is dropped with a 503
    max_bytes: int = 8 * 2**20  # request body limit (413 above it)
    max_pixels: int = images.DEFAULT_MAX_PIXELS  # decoded image limit (413 above it: decompression bombs)
    max_images: int = 64  # images in one /classify_batch request
    access_log: bool = False  # BentoML's access log line per request (~0.6 ms of the event loop each: off)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        d = cls()
        backend = env.get("CAPSERVE_BACKEND", d.backend).strip() or d.backend
        if backend not in BACKENDS:
            raise ConfigurationError(f"CAPSERVE_BACKEND={backend!r}; choose one of: {', '.join(BACKENDS)}")
        settings = cls(
            model=env.get("CAPSERVE_MODEL", "").strip() or d.model,
            multilabel_model=env.get("CAPSERVE_MULTILABEL_MODEL", "").strip() or d.multilabel_model,
            backend=backend,
            device=env.get("CAPSERVE_DEVICE", "").strip() or d.device,
            iterations=_int(env, "CAPSERVE_ITERATIONS", None, 1),
            max_batch_size=_int(env, "CAPSERVE_MAX_BATCH_SIZE", d.max_batch_size, 1),
            max_latency_ms=_int(env, "CAPSERVE_MAX_LATENCY_MS", d.max_latency_ms, 1),
            max_bytes=_int(env, "CAPSERVE_MAX_BYTES", d.max_bytes, 1024),
            max_pixels=_int(env, "CAPSERVE_MAX_PIXELS", d.max_pixels, 64),
            max_images=_int(env, "CAPSERVE_MAX_IMAGES", d.max_images, 1),
            precision=env.get("CAPSERVE_PRECISION", "").strip().lower() or d.precision,
            bf16_min_agreement=_fraction(env, "CAPSERVE_BF16_MIN_AGREEMENT", d.bf16_min_agreement),
            access_log=_flag(env, "CAPSERVE_ACCESS_LOG", d.access_log),
        )
        if settings.precision not in PRECISIONS:
            raise ConfigurationError(f"CAPSERVE_PRECISION={settings.precision!r}; choose one of: "
                                     f"{', '.join(PRECISIONS)}")  # fmt: skip
        if settings.precision == "bf16" and backend != "torch":
            raise ConfigurationError(f"CAPSERVE_PRECISION=bf16 works with the torch backend only: {backend} serves "
                                     "the precision of its exported graph. Set CAPSERVE_BACKEND=torch, or "
                                     "CAPSERVE_PRECISION=fp32 or auto")  # fmt: skip
        if settings.iterations is not None and backend != "torch":
            raise ConfigurationError(f"CAPSERVE_ITERATIONS works with the torch backend only: {backend} artifacts "
                                     "fix the routing iterations at export; re-export with `capserve export onnx DIR "
                                     "-o DIR/model.onnx -T N` or unset CAPSERVE_ITERATIONS")  # fmt: skip
        return settings


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    text = env.get(name, "").strip().lower()
    if not text:
        return default
    if text not in ("0", "1", "true", "false"):
        raise ConfigurationError(f"{name}={text!r}: use 1 or 0")
    return text in ("1", "true")


def _fraction(env: Mapping[str, str], name: str, default: float) -> float:
    text = env.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise ConfigurationError(f"{name}={text!r} is not a number") from None
    if not 0 <= value <= 1:
        raise ConfigurationError(f"{name}={value} must be in [0, 1]")
    return value


ARTIFACTS = {"onnxruntime": "model.onnx", "tensorrt": "model.plan"}
EXPLAIN_ARTIFACT = "model-explain.onnx"
STORE_TAG = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(:[A-Za-z0-9_.-]+)?$")  # BentoML's NAME[:VERSION]


@dataclass(frozen=True)
class ModelSource:
    """Where a served model came from: its folder, and its BentoML model-store tag when it came from the store."""

    path: Path
    tag: str | None = None


def resolve_model(spec: str) -> ModelSource:
    """``CAPSERVE_MODEL``'s value → the model folder: a directory, or ``NAME[:VERSION]`` in BentoML's model store
    (``capserve export bentoml``; inside a bento, the store is the bento's own models folder)."""
    path = Path(spec)
    if path.is_dir() or not STORE_TAG.match(spec):
        return ModelSource(path)
    try:
        import bentoml
        from bentoml.exceptions import NotFound
    except ImportError:
        return ModelSource(path)
    try:
        stored = bentoml.models.get(spec)
    except NotFound:
        return ModelSource(path)  # open_model says that neither exists
    except ValueError as e:  # a malformed tag
        raise ConfigurationError(f"model {spec!r}: {e}") from e
    return ModelSource(Path(stored.path), str(stored.tag))


def open_model(spec: str, settings: Settings) -> tuple[Runtime, Runtime | None, ModelSource]:
    """The runtime for predictions, the one for explanations (None when the model has none), and the source."""
    source = resolve_model(spec)
    path = source.path
    if not path.is_dir():
        home = os.environ.get("BENTOML_HOME", "~/bentoml")
        raise ConfigurationError(f"model {spec!r} is neither a directory (working directory {Path.cwd()}) nor a "
                                 f"model in BentoML's model store ({home}): set CAPSERVE_MODEL / "
                                 "CAPSERVE_MULTILABEL_MODEL to a directory made by `capserve train` or "
                                 "model.save(dir), or save one to the store with `capserve export bentoml DIR "
                                 "--name NAME`")  # fmt: skip
    try:
        if settings.backend == "torch":
            runtime, _ = open_torch(path, settings.device, settings.iterations, settings.precision,
                                    settings.bf16_min_agreement)  # fmt: skip
            return runtime, runtime if has_routing(runtime) else None, source
        artifact = path / ARTIFACTS[settings.backend]
        if not artifact.is_file():
            fix = (f"capserve export onnx {path} -o {artifact}" if settings.backend == "onnxruntime"
                   else f"capserve export tensorrt {path / 'model.onnx'} -o {artifact}")  # fmt: skip
            raise ConfigurationError(f"{path} has no {artifact.name}, which the {settings.backend} backend "
                                     f"serves: run `{fix}` first, or set CAPSERVE_BACKEND=torch")  # fmt: skip
        runtime = load_runtime(artifact, settings.backend, settings.device, **lone_request_options(settings))
        _, runtime.precision_reason = resolve_precision(settings.precision, settings.backend, settings.device)
        explainer = None
        if (path / EXPLAIN_ARTIFACT).is_file():
            explainer = load_runtime(path / EXPLAIN_ARTIFACT, "onnxruntime", settings.device)
            explainer.precision_reason = runtime.precision_reason
        elif has_routing(runtime):
            log.warning("%s has no %s: /explain is off (run `capserve export onnx %s -o %s --explain`)", path,
                        EXPLAIN_ARTIFACT, path, path / EXPLAIN_ARTIFACT)  # fmt: skip
        return runtime, explainer, source
    except (RuntimeLoadError, ValueError) as e:
        if isinstance(e, ConfigurationError):
            raise
        if isinstance(e, PrecisionError):
            raise ConfigurationError(f"CAPSERVE_PRECISION={settings.precision}: {e}") from e
        raise ConfigurationError(f"cannot load the model in {path} with the {settings.backend} backend: {e}") from e


# ---------------------------------------------------------------------------- request guard (ASGI)


def _json_response(status: int, message: str) -> tuple[dict[str, Any], dict[str, Any]]:
    body = json.dumps({"error": message}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    start = {"type": "http.response.start", "status": status, "headers": headers}
    return start, {"type": "http.response.body", "body": body}


class RequestGuard:
    """ASGI middleware in front of BentoML: a body size limit (413) and the image routes' body formats.

    The image routes take a multipart form (the API's parameters, the image(s) as file fields; parameters may also
    be in the query string) or a raw ``image/*`` (or ``application/octet-stream``) body with the other parameters in
    the query string. The body is parsed
    here, once: malformed forms and file fields sent as text (which BentoML would fetch as URLs) get a 400, and any
    other content type a 415. BentoML then receives the parameters as JSON, each image as a token for the bytes
    parsed here (``guarded_upload``), instead of parsing the form a second time and writing each upload to a
    temporary file for a ``Path`` parameter.
    """

    def __init__(self, app: Any, max_bytes: int, file_fields: Mapping[str, str], get_routes: tuple[str, ...] = (),
                 unavailable: Mapping[str, str] | None = None, list_fields: frozenset[str] = frozenset(),
                 parameters: Mapping[str, frozenset[str]] | None = None):  # fmt: skip
        self.app, self.max_bytes, self.file_fields, self.get_routes = app, max_bytes, dict(file_fields), get_routes
        self.unavailable = dict(unavailable or {})  # route → the 501 message (``unavailable_routes``)
        self.list_fields = list_fields  # file fields that take a list of images
        # route → its API's parameter names (``route_parameters``): any other name is a 400, not silently ignored
        self.parameters = dict(parameters or {})

    @staticmethod
    def _body_once(body: bytes, then: Any = None) -> Any:
        """An ASGI receive() that gives ``body`` once, then defers to ``then`` (the real one: disconnects)."""
        sent = False

        async def receive() -> dict:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            if then is None:
                return {"type": "http.disconnect"}
            return await then()

        return receive

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        _request_error.set({})
        send = one_error_shape(scope, send)
        if scope["method"] == "GET" and scope["path"].rstrip("/") in self.get_routes:
            # BentoML APIs answer POST only; a GET on a parameterless API is the same call with an empty JSON body
            headers = self._replace_headers(scope["headers"], "application/json", 2)
            scope, receive = {**scope, "method": "POST", "headers": headers}, self._body_once(b"{}", receive)
            return await self.app(scope, receive, send)
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        if scope["path"].rstrip("/") in self.unavailable:
            return await self._reply(send, 501, self.unavailable[scope["path"].rstrip("/")])
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            declared = int(headers.get("content-length", "0"))
        except ValueError:
            return await self._reply(send, 400, "Content-Length is not an integer")
        if declared > self.max_bytes:
            return await self._reply(send, 413, self._too_large(declared))
        field = self.file_fields.get(scope["path"].rstrip("/"))
        if field is None and "content-length" in headers:
            return await self.app(scope, receive, send)  # within the limit: nothing to check or rewrite
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await self._reply(send, 413, self._too_large(size))
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if field is not None:
            media = headers.get("content-type", "").split(";")[0].strip().lower()
            if media.startswith("image/") or media == "application/octet-stream":
                if not body:
                    return await self._reply(send, 400, "the request body is empty; send an image")
                try:
                    parameters = self._query_parameters(scope.get("query_string", b""), field)
                except ValueError as e:
                    return await self._reply(send, 400, str(e))
                images = [body]
            elif media == "multipart/form-data":
                parsed = await self._read_form(scope, body, field)
                if isinstance(parsed[0], int):
                    return await self._reply(send, *parsed)
                parameters, images = parsed
                # parameters may come in the query string as well (``curl -F image=@x.png '…/classify?top_k=1'``)
                try:
                    query = self._query_parameters(scope.get("query_string", b""), field)
                except ValueError as e:
                    return await self._reply(send, 400, str(e))
                twice = sorted(name for name in query if name in parameters and query[name] != parameters[name])
                if twice:
                    return await self._reply(send, 400, f"{', '.join(twice)}: given in the form and in the query "
                                                        "string with different values; give it once")  # fmt: skip
                parameters = {**query, **parameters}
            elif not body:
                return await self._reply(send, 400, f"the request body is empty; send an image as the multipart "
                                                    f"file field {field!r} or as a raw image/* body")  # fmt: skip
            else:
                return await self._reply(send, 415, f"Content-Type {media or '(none)'!r} is not accepted here; send "
                                                    f"multipart/form-data with the file field {field!r}, or a raw "
                                                    "image/* body")  # fmt: skip
            known = self.parameters.get(scope["path"].rstrip("/"))
            unknown = sorted(set(parameters) - known) if known is not None else []
            if unknown:
                return await self._reply(send, 400, f"{', '.join(map(repr, unknown))}: not a parameter of "
                                                    f"{scope['path'].rstrip('/')} (its parameters: "
                                                    f"{', '.join(sorted(known - {field}))})")  # fmt: skip
            uploads = {f"{UPLOAD_TOKEN}{i}": image for i, image in enumerate(images)}
            _uploads.set(uploads)
            tokens = list(uploads)
            parameters[field] = tokens if field in self.list_fields else tokens[0]
            body = json.dumps(parameters).encode()
            scope = {**scope, "headers": self._replace_headers(scope["headers"], "application/json", len(body))}
        return await self.app(scope, self._body_once(body, receive), send)

    def _too_large(self, size: int) -> str:
        return f"the request body is {size:,} bytes; the limit is {self.max_bytes:,} (CAPSERVE_MAX_BYTES)"

    @staticmethod
    async def _reply(send: Any, status: int, message: str) -> None:
        start, body = _json_response(status, message)
        await send(start)
        await send(body)

    @staticmethod
    def _value(text: str | bytes) -> Any:
        """A form field or query parameter as BentoML reads it: JSON when it parses (``5``, ``0.3``), else text."""
        try:
            return json.loads(text)
        except ValueError:
            return text.decode("utf-8", "replace") if isinstance(text, bytes) else text

    @staticmethod
    def _query_parameters(query_string: bytes, field: str) -> dict[str, Any]:
        parameters = {}
        for name, value in parse_qsl(query_string.decode("latin-1")):
            if not name.isidentifier() or "\r" in value or "\n" in value:
                raise ValueError(f"query parameter {name!r} is not a valid API parameter")
            if name != field:
                parameters[name] = RequestGuard._value(value)
        return parameters

    @staticmethod
    def _replace_headers(raw: list, content_type: str, length: int) -> list:
        kept = [(k, v) for k, v in raw if k.lower() not in (b"content-type", b"content-length")]
        return [*kept, (b"content-type", content_type.encode()), (b"content-length", str(length).encode())]

    @staticmethod
    async def _read_form(scope: dict, body: bytes, field: str) -> tuple[int, str] | tuple[dict[str, Any], list[bytes]]:
        """The form's other fields (as BentoML reads them) and the file field's images, or (status, message)."""
        from starlette.datastructures import UploadFile
        from starlette.requests import Request

        request = Request({k: v for k, v in scope.items() if k != "app"}, RequestGuard._body_once(body))
        try:
            form = await request.form()
        except Exception as e:  # starlette raises MultiPartException, or HTTPException when it knows the app
            return 400, f"malformed multipart body: {getattr(e, 'detail', None) or getattr(e, 'message', None) or e}"
        try:
            values = form.getlist(field)
            if not values:
                return 400, (f"the multipart body has no file field {field!r} (it has: "
                             f"{', '.join(sorted(set(form.keys()))) or 'nothing'})")  # fmt: skip
            if not all(isinstance(v, UploadFile) for v in values):
                return 400, f"the field {field!r} must be a file upload, not text"
            for value in values:
                part_type = (value.content_type or "").split(";")[0].strip().lower()
                if not part_type.startswith("image/"):
                    return 415, (f"the file part {field!r} has Content-Type {part_type or '(none)'!r}; send it as "
                                 "image/* (e.g. curl -F 'image=@cat.png;type=image/png')")  # fmt: skip
            images = [await value.read() for value in values]
            parameters = {}
            for name in form:
                if name != field:
                    value = form[name]
                    parameters[name] = RequestGuard._value(await value.read() if isinstance(value, UploadFile)
                                                           else value)  # fmt: skip
        finally:
            await form.close()
        return parameters, images


# The images of the current request, parsed by RequestGuard: token → bytes (the JSON BentoML receives names them).
_uploads: ContextVar[dict[str, bytes] | None] = ContextVar("capserve_uploads", default=None)
UPLOAD_TOKEN = "capserve-upload:"


def guarded_upload(value: Any, handler: Any) -> Any:
    """Pydantic wrap validator of the image parameters: an upload token → the bytes RequestGuard parsed from this
    request. Anything else goes to BentoML's own validation (a ``Path`` parameter: the upload in a temporary file)."""
    if isinstance(value, str) and value.startswith(UPLOAD_TOKEN):
        uploads = _uploads.get() or {}
        if value not in uploads:
            raise ValueError("send the image as a multipart file upload or as a raw image/* body")
        return uploads[value]
    return handler(value)


GUARDED_UPLOAD = WrapValidator(guarded_upload)  # service.py: Annotated[Path, ContentType("image/*"), GUARDED_UPLOAD]


def error_message(status: int, body: bytes) -> str:
    """The one message of an error body in any of the shapes BentoML and Starlette send: ``{"error": ...}``,
    ``[{"error": ...}]`` (BentoML's 4xx), ``{"error": ..., "detail": [pydantic errors]}``, or plain text."""
    try:
        data = json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace").strip() or HTTPStatus(status).phrase
    while isinstance(data, list) and data:
        data = data[0]
    if not isinstance(data, dict):
        return str(data)
    details = data.get("detail")
    if isinstance(details, list) and details and all(isinstance(d, dict) for d in details):
        # pydantic: [{"loc": ["top_k"], "msg": "Input should be greater than or equal to 1", ...}]
        return "; ".join(f"{'.'.join(str(p) for p in d.get('loc', ())) or 'request'}: {d.get('msg', d)}"
                         for d in details)  # fmt: skip
    message = data.get("error", data.get("detail", data))
    return message if isinstance(message, str) else json.dumps(message)


def one_error_shape(scope: dict, send: Any) -> Any:
    """An ASGI send() that rewrites every error response to ``{"error": "..."}`` and logs it as one line
    (method, path, status, reason); other responses pass through untouched. BentoML replaces the message of its
    5xx responses with a generic one: a ``RequestError`` raised in this request (503, 501) leaves its own."""
    held: dict[str, Any] = {}

    async def wrapped(message: dict) -> None:
        if message["type"] == "http.response.start" and message["status"] >= 400:
            held["start"], held["body"] = message, b""
            return None
        if "start" not in held or message["type"] != "http.response.body":
            return await send(message)
        held["body"] += message.get("body", b"")
        if message.get("more_body", False):
            return None
        status = held["start"]["status"]
        known = _request_error.get() or {}
        reason = known.get("message") or error_message(status, held["body"])  # BentoML hides 5xx messages
        (log.warning if status < 500 else log.error)("%s %s %d %s", scope["method"], scope["path"], status, reason)
        start, body = _json_response(status, reason)
        start["headers"] += [(k, v) for k, v in held["start"].get("headers", [])
                             if k.lower() not in (b"content-type", b"content-length")]  # fmt: skip
        held.clear()
        await send(start)
        await send(body)

    return wrapped


# the message of the RequestError raised while serving the current request (set per request by RequestGuard)
_request_error: ContextVar[dict[str, str] | None] = ContextVar("capserve_request_error", default=None)


class QuietClientErrors(logging.Filter):
    """Drops BentoML's "Exception on PATH" ERROR record (with traceback) for client errors (4xx, validation):
    ``one_error_shape`` logs each of them as one line instead. Server errors keep their traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if error is None:
            return True
        if type(error).__name__ == "ValidationError":  # pydantic's: the request's fields
            return False
        code = getattr(error, "error_code", None)
        return not (code is not None and 400 <= int(code) < 500)


# ---------------------------------------------------------------------------- results


def softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(axis=-1, keepdims=True)  # (B, C)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def sigmoid(logits: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-logits))


# A diverging blue → pale → red ramp for the heat-map (no plotting library in the server): the middle is uniform.
RAMP = np.array([[49, 54, 149], [69, 117, 180], [116, 173, 209], [224, 243, 248], [254, 224, 144],
                 [253, 174, 97], [244, 109, 67], [215, 48, 39]], dtype=np.float32)  # fmt: skip
HEATMAP_OCTAVES = 2.0  # the colour scale spans 1/4× (blue) .. uniform (middle) .. 4× uniform (red)


def vs_uniform(probabilities: np.ndarray, classes: int) -> np.ndarray:
    """Routing probabilities as multiples of uniform routing (1/classes): 1 = no preference."""
    return probabilities * classes


def selectivity(part_whole: np.ndarray) -> float:
    """How far routing is from uniform, in [0, 1]: 1 − mean normalised entropy of each grid capsule's routing
    distribution over the classes (part_whole (C, H, W, I), summing to 1 over C). 0: every capsule routes
    uniformly (the picture shows nothing); 1: every capsule routes to one class."""
    C = part_whole.shape[0]
    p = np.clip(part_whole.reshape(C, -1), 1e-12, 1.0)  # (C, H·W·I)
    entropy = -(p * np.log(p)).sum(axis=0) / np.log(C)  # (H·W·I,) in [0, 1]
    return float(np.clip(1.0 - entropy.mean(), 0.0, 1.0))


def heatmap_png(image: np.ndarray, grid: np.ndarray, scale: int = 8, alpha: float = 0.55) -> bytes:
    """A PNG of ``grid`` (h, w), routing as multiples of uniform, on a FIXED log scale (``HEATMAP_OCTAVES``
    octaves either side of uniform, which is the ramp's pale middle), bilinearly upsampled and blended over
    ``image`` uint8 (C, H, W). Near-uniform routing stays pale: the picture is never stretched to full colour."""
    from PIL import Image

    C, H, W = image.shape
    g = (np.log2(np.clip(grid, 1e-6, None)) / HEATMAP_OCTAVES + 1) / 2  # (h, w): 0.5 is uniform
    size = (W * scale, H * scale)
    g = np.asarray(Image.fromarray(g.astype(np.float32), "F").resize(size, Image.Resampling.BILINEAR))  # (H', W')
    position = np.clip(g, 0, 1) * (len(RAMP) - 1)
    lo = np.floor(position).astype(int).clip(0, len(RAMP) - 2)
    colors = RAMP[lo] + (position - lo)[..., None] * (RAMP[lo + 1] - RAMP[lo])  # (H', W', 3)
    base = np.asarray(Image.fromarray(image[0] if C == 1 else image.transpose(1, 2, 0)).convert("RGB"))
    base = np.asarray(Image.fromarray(base).resize(size, Image.Resampling.NEAREST), dtype=np.float32)
    blended = ((1 - alpha) * base + alpha * colors).round().clip(0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(blended, "RGB").save(buffer, format="PNG")
    return buffer.getvalue()


# ---------------------------------------------------------------------------- API results


class Label(BaseModel):
    label: str
    index: int
    probability: float


Iterations = Annotated[int | None, Field(description="routing iterations T; null: the model is a CNN without routing")]


class Classification(BaseModel):
    model: str
    iterations: Iterations
    predictions: list[Label] = Field(description="the top_k labels, most probable first")


class MultiLabel(BaseModel):
    model: str
    iterations: Iterations
    threshold: float | None = Field(description="the threshold the request set; None: the model's own thresholds")
    labels: list[Label] = Field(description="every label whose probability passed its threshold, most probable first")
    probabilities: dict[str, float]
    thresholds: dict[str, float]


class Capsule(BaseModel):
    type: int = Field(description="capsule type (channel) in the last grid capsule layer")
    row: int
    col: int
    routing_probability: float = Field(description="routing probability from this capsule to the class, in [0, 1]")
    vs_uniform: float = Field(description="routing_probability as a multiple of uniform routing (1/classes)")


class Explained(BaseModel):
    model: str
    iterations: int
    prediction: Label
    uniform: float = Field(description="the routing probability of uniform routing: 1/classes")
    selectivity: float = Field(description="0: routing is uniform (nothing to see), 1: each capsule picks one class")
    grid: list[list[float]] = Field(description="mean routing probability to the class over capsule types, per cell")
    capsules: list[Capsule] = Field(description="the most strongly routed capsules, strongest first")
    heatmap_png: str = Field(description="base64 PNG: the grid vs uniform on a fixed log scale (1/4× blue, uniform "
                                         "pale, 4× red) over the input")  # fmt: skip


def has_routing(runtime: Runtime) -> bool:
    """False for a CNN baseline: its metadata has no routing iterations (``ModelMetadata.iterations`` is None)."""
    return runtime.metadata.iterations is not None


def top_labels(probabilities: np.ndarray, labels: tuple[str, ...], k: int, passed: np.ndarray | None = None
               ) -> list[Label]:  # fmt: skip
    """The ``k`` most probable labels (of those ``passed``, a boolean mask, when given), most probable first."""
    order = np.argsort(-probabilities, kind="stable")
    if passed is not None:
        order = order[passed[order]]
    return [Label(label=labels[i], index=int(i), probability=float(probabilities[i])) for i in order[:k]]


# ---------------------------------------------------------------------------- request errors


class RequestError(ValueError):
    """A request the service refuses; ``status`` is its HTTP status (the README's error table)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


_HTTP_ERRORS: dict[int, type] = {}


def http_error(error: RequestError) -> Exception:
    """``error`` as the BentoML exception that makes BentoML answer with its status."""
    from bentoml.exceptions import BentoMLException

    known = _request_error.get()
    if known is not None:
        known["message"] = str(error)
    if error.status not in _HTTP_ERRORS:
        _HTTP_ERRORS[error.status] = type(f"HTTP{error.status}", (BentoMLException,),
                                          {"error_code": HTTPStatus(error.status)})  # fmt: skip
    return _HTTP_ERRORS[error.status](str(error))


IMAGE_ERRORS: dict[type[images.ImageError], int] = {
    images.ImageTooLargeError: 413,
    images.ImageTooSmallError: 422,
    images.UnsupportedImageError: 422,
}


Upload = bytes | Path  # an image parameter: the bytes RequestGuard parsed (``guarded_upload``), or a file


def decode(upload: Upload, runtime: Runtime, max_pixels: int, what: str = "the image") -> np.ndarray:
    """An uploaded image → uint8 (C, H, W) for ``runtime``'s model; bad images raise ``RequestError``.

    ``what`` names the upload in messages (the client never sees BentoML's temporary file names).
    """
    data = upload if isinstance(upload, bytes) else upload.read_bytes()
    try:
        return images.load_image(data, runtime.metadata, max_pixels)
    except images.ImageError as e:
        raise RequestError(IMAGE_ERRORS.get(type(e), 400), f"{what}: {e}") from e


# ---------------------------------------------------------------------------- the server process

FAILED_START_SIGNAL = signal.SIGUSR2  # worker → server process: the model could not be loaded
FAILED_START_EXIT_CODE = 3
SERVER_PID_VARIABLE = "CAPSERVE_SERVER_PID"  # set by the server process for its workers: whom to signal
_failed_start = threading.Event()


def prepare_server_process() -> None:
    """Run at the service module's import, in the ``bentoml serve`` process and in its worker.

    - A worker that cannot load its model signals the server process, which stops and exits with status 3
      (BentoML would respawn the worker forever, or stop with status 0: orchestrators would see success).
    - Each server gets its own Prometheus folder: BentoML's default is one folder under BENTOML_HOME that
      every ``bentoml serve`` empties at start, resetting the ``/metrics`` of servers already running.
    - BentoML's ERROR-with-traceback for client errors is dropped (each is logged as one line instead).
    - Without a tracing exporter, requests skip OpenTelemetry (``untraced_without_exporter``).
    """
    logging.getLogger("bentoml._internal.server.http_app").addFilter(QuietClientErrors())
    untraced_without_exporter()
    if threading.current_thread() is not threading.main_thread():
        return  # imported by a test or a tool, not by a server: signal handlers are the main thread's
    signal.signal(FAILED_START_SIGNAL, _on_failed_start)
    atexit.register(_exit_status)
    os.environ.setdefault(SERVER_PID_VARIABLE, str(os.getpid()))  # the server process: its workers inherit it
    if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:  # the server process (its workers inherit the variable)
        try:
            from bentoml._internal.configuration.containers import BentoMLContainer
        except ImportError:
            return
        folder = tempfile.mkdtemp(prefix="capserve-metrics-")
        BentoMLContainer.prometheus_multiproc_dir.set(folder)
        atexit.register(shutil.rmtree, folder, True)


def freeze_startup_heap() -> None:
    """Exempt every object the server process holds once it has started (libraries, models, warm-up) from Python's
    cyclic garbage collector (``gc.freeze``). Its full collections otherwise walk those long-lived objects over and
    over under load: 14 % of the event loop's CPU per ``/multilabel`` request (README "Where the time went", item 6).
    Called by the service once its models are loaded; requests' own objects are collected as before."""
    gc.collect()
    gc.freeze()


def untraced_without_exporter() -> bool:
    """When BentoML's configuration names no tracing exporter (``tracing.exporter_type``) and no
    ``tracing.excluded_urls``, exclude every URL from its OpenTelemetry middleware: True when it did.

    BentoML runs every request through that middleware (a server span, and a span per receive and per send) even
    when no exporter is configured and nothing can be recorded; that was about 40 % of the event loop's work per
    image request (README "Where the time went"). With an exporter configured, requests are traced as before.
    """
    try:
        from bentoml._internal.configuration.containers import BentoMLContainer
        from opentelemetry.util.http import ExcludeList
    except ImportError:
        return False
    tracing = BentoMLContainer.config.tracing
    if tracing.exporter_type.get() is not None or tracing.excluded_urls.get() is not None:
        return False
    BentoMLContainer.tracing_excluded_urls.set(ExcludeList([".*"]))  # a regex searched in each request's URL
    return True


def settings_or_exit(env: Mapping[str, str] | None = None) -> Settings:
    """``Settings.from_env()`` for the service module's import: a bad setting stops the server with one line
    and exit status 3 (not a traceback and status 1), as a model that cannot load does."""
    try:
        return Settings.from_env(env)
    except ConfigurationError as e:
        print(f"capserve cannot start: {e}", file=sys.stderr, flush=True)
        raise SystemExit(FAILED_START_EXIT_CODE) from None


def _on_failed_start(signum: int, frame: Any) -> None:
    _failed_start.set()
    os.kill(os.getpid(), signal.SIGTERM)  # BentoML's (circus's) graceful stop; the exit status is set at exit


def _exit_status() -> None:
    if _failed_start.is_set():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(FAILED_START_EXIT_CODE)


def report_failed_start() -> None:
    """Called by a worker whose model cannot be loaded: stop the server process with a non-zero status.

    Only a worker of a server that ``prepare_server_process`` set up signals, and only that server: ``Capsules``
    used in-process (a script, a test) must never signal whatever process happens to be its parent."""
    server = os.environ.get(SERVER_PID_VARIABLE)
    if os.environ.get("CAPSERVE_EXIT_ON_FAILURE", "1") != "0" and server == str(os.getppid()):
        os.kill(os.getppid(), FAILED_START_SIGNAL)


# ---------------------------------------------------------------------------- the service's logic


class Capsules:
    """What the service does, for ``service.py`` to expose: the runtimes (loaded once and warmed up), adaptive
    batching of single-image requests, and one method per endpoint. Bad requests raise ``error(RequestError)``
    (``http_error``: BentoML's exceptions, answered with the right status)."""

    def __init__(self, settings: Settings, error: Any = http_error):
        self.settings, self.error, self.ready = settings, error, False
        try:
            self.runtime, self.explainer, self.source = open_model(settings.model, settings)
            self.multilabel_runtime: Runtime | None = None
            self.multilabel_source: ModelSource | None = None
            if settings.multilabel_model.lower() != "none":
                self.multilabel_runtime, _, self.multilabel_source = open_model(settings.multilabel_model, settings)
                if self.multilabel_runtime.metadata.task != "multi_label":
                    raise ConfigurationError(f"CAPSERVE_MULTILABEL_MODEL={settings.multilabel_model} is a "
                                             f"{self.multilabel_runtime.metadata.task} model; give a multi_label "
                                             "one or 'none'")  # fmt: skip
            self.batching = settings.max_batch_size > 1
            self._batchers: dict[bool, Any] = {}  # multilabel → batched predict
            # multilabel → the runtime its adaptive batches run on (a separate ONNX Runtime session on CPUs)
            self._batch_runtimes: dict[bool, Runtime] = {}
            for multilabel, runtime in ((False, self.runtime), (True, self.multilabel_runtime)):
                if runtime is not None and self.batching:
                    self._batch_runtimes[multilabel] = batch_runtime(runtime, settings)
            self._pending = {False: 0, True: 0}  # multilabel → single-image requests decoding, queued or running
            self._warm_up()
        except Exception as e:  # any failed start stops the server (exit 3); unexpected ones with their traceback
            log.critical("capserve cannot start: %s", e, exc_info=not isinstance(e, ConfigurationError))
            report_failed_start()
            raise

    def _warm_up(self) -> None:
        """One inference per loaded runtime (and explanation graph): readiness means a real answer came back."""
        try:
            served = (self.runtime, self.multilabel_runtime, self.explainer)
            batch_sessions = [r for r in self._batch_runtimes.values() if all(r is not s for s in served)]
            for runtime in (*served, *batch_sessions):
                if runtime is None:
                    continue
                zeros = images.normalize_images(
                    np.zeros((1, *runtime.metadata.input_shape), np.uint8), runtime.metadata
                )
                logits = runtime.predict(zeros)
                if logits.shape != (1, len(runtime.metadata.labels)) or not np.isfinite(logits).all():
                    raise ConfigurationError(f"warm-up inference of {runtime.metadata.name} gave {logits.shape} "
                                             "logits with non-finite values or the wrong shape")  # fmt: skip
                if runtime is self.explainer:
                    runtime.explain(zeros)
            for runtime in self._batch_runtimes.values():
                if runtime.backend == "torch" and self.settings.device == "cpu":
                    # a full batch, so that big routing steps compile their fused kernel (capserve.routing; seconds,
                    # once per shape) now rather than in the first busy moment's requests
                    full = np.zeros((self.settings.max_batch_size, *runtime.metadata.input_shape), np.uint8)
                    runtime.predict(images.normalize_images(full, runtime.metadata))
        except (InputError, NotImplementedError, RuntimeError, AssertionError) as e:
            raise ConfigurationError(f"warm-up inference failed: {e}") from e
        self.ready = True
        log.info("capserve ready: %s (%s %s on %s, providers %s), batching %s", self.runtime.metadata.name,
                 self.settings.backend, self.runtime.precision, self.settings.device, self.runtime.providers,
                 f"up to {self.settings.max_batch_size}" if self.batching else "off")  # fmt: skip

    def fail(self, status: int, message: str) -> Exception:
        return self.error(RequestError(status, message))

    def predict(self, runtime: Runtime, pixels: np.ndarray) -> np.ndarray:
        """uint8 (B, C, H, W) → float32 logits (B, classes); bad pixels or shapes are 400s."""
        if pixels.dtype != np.uint8:  # JSON tensors arrive as int64
            if pixels.dtype.kind not in "iu" or pixels.size == 0 or pixels.min() < 0 or pixels.max() > 255:
                raise self.fail(400, f"images must be integer pixels in [0, 255], got {pixels.dtype} values")
            pixels = pixels.astype(np.uint8)
        try:
            return runtime.predict(images.normalize_images(pixels, runtime.metadata))
        except InputError as e:
            raise self.fail(400, str(e)) from e

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
            return self.predict(runtime, decode(image, runtime, max_pixels)[None])  # (1, classes)

        if not self.batching:
            return await self.run(decode_and_predict)
        self._pending[multilabel] += 1
        try:
            if self._pending[multilabel] == 1:
                batch_size_histogram().labels(endpoint=ENDPOINTS[multilabel]).observe(1)
                return await self.run(decode_and_predict)
            pixels = self.decode_small(image, runtime)
            if pixels is None:
                pixels = await self.run(decode, image, runtime, max_pixels)
            if multilabel not in self._batchers:  # created on first use: the engine binds to the running event loop
                self._batchers[multilabel] = self._batcher(runtime, multilabel)
            return await self._batchers[multilabel](pixels[None])
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
            if isinstance(e.__cause__, images.ImageTooLargeError):
                return None  # only too large to decode here: a worker thread checks it against the real limit
            raise self.error(e) from e

    def _batcher(self, runtime: Runtime, multilabel: bool) -> Any:
        """BentoML's adaptive batching engine (the CorkDispatcher behind batchable APIs) around ``runtime``.

        Called in-process: BentoML's own in-process client to a batchable API (``self.to_async``) loses
        responses under concurrency (aiohttp "Server disconnected"), so the endpoints use the engine directly.
        """
        from bentoml._internal.marshal.dispatcher import CorkDispatcher, NonBlockSema

        settings = self.settings

        def overloaded() -> Any:
            raise self.fail(503, f"the batching queue held this request over {settings.max_latency_ms} ms "
                                 "(CAPSERVE_MAX_LATENCY_MS); retry later")  # fmt: skip

        batch_runtime = self._batch_runtimes.get(multilabel, runtime)
        in_flight = self.batches_in_flight(multilabel)
        dispatcher = CorkDispatcher(max_latency_in_ms=settings.max_latency_ms, max_batch_size=settings.max_batch_size,
                                    fallback=overloaded, get_batch_size=len, batch_dim=(0, 0),
                                    shared_sema=NonBlockSema(in_flight))  # fmt: skip
        endpoint = ENDPOINTS[multilabel]

        async def infer(batches: list[np.ndarray]) -> list[np.ndarray]:
            batch_size_histogram().labels(endpoint=endpoint).observe(len(batches))
            logits = await self.run(self.predict, batch_runtime, np.concatenate(batches))  # (B, classes)
            return list(np.split(logits, np.cumsum([len(b) for b in batches])[:-1]))

        return dispatcher(infer)

    def batches_in_flight(self, multilabel: bool = False) -> int:
        """How many adaptive batches may run at once: ``BATCHES_IN_FLIGHT`` on a separate batch session (ONNX
        Runtime on a CPU, ``batch_runtime``), else 1 (BentoML's default); 0 with batching off."""
        if not self.batching:
            return 0
        runtime = self.multilabel_runtime if multilabel else self.runtime
        return BATCHES_IN_FLIGHT if self._batch_runtimes.get(multilabel, runtime) is not runtime else 1

    def check_top_k(self, top_k: int) -> None:
        labels = len(self.runtime.metadata.labels)
        if top_k > labels:
            raise self.fail(400, f"top_k={top_k} but the model has {labels} labels: give 1..{labels}")

    async def classify(self, image: Upload, top_k: int) -> Classification:
        meta = self.runtime.metadata
        self.check_top_k(top_k)
        probabilities = softmax(await self.upload_logits(image))[0]  # (C,)
        return Classification(model=meta.name, iterations=meta.iterations,
                              predictions=top_labels(probabilities, meta.labels, top_k))  # fmt: skip

    async def classify_batch(self, files: list[Upload], top_k: int) -> list[Classification]:
        meta, settings = self.runtime.metadata, self.settings
        if not files:
            raise self.fail(400, "send at least one image in the multipart field 'images'")
        if len(files) > settings.max_images:
            raise self.fail(413, f"{len(files)} images in one request; the limit is {settings.max_images} "
                                 "(CAPSERVE_MAX_IMAGES)")  # fmt: skip
        self.check_top_k(top_k)

        def run() -> np.ndarray:
            pixels = [decode(path, self.runtime, settings.max_pixels, f"image {i}") for i, path in enumerate(files)]
            batch = np.stack(pixels)  # (B, C, H, W)
            step = settings.max_batch_size
            return np.concatenate([self.predict(self.runtime, batch[i : i + step]) for i in range(0, len(batch), step)])

        probabilities = softmax(await self.run(run))  # (B, C)
        return [Classification(model=meta.name, iterations=meta.iterations,
                               predictions=top_labels(p, meta.labels, top_k)) for p in probabilities]  # fmt: skip

    async def multilabel(self, image: Upload, threshold: float | None) -> MultiLabel:
        runtime = self.multilabel_model()
        meta = runtime.metadata
        probabilities = sigmoid(await self.upload_logits(image, multilabel=True))[0]  # (C,)
        if threshold is not None:
            thresholds = np.full(len(meta.labels), threshold)
        else:
            thresholds = np.array(meta.thresholds if meta.thresholds is not None else [0.5] * len(meta.labels))
        passed = top_labels(probabilities, meta.labels, len(meta.labels), probabilities >= thresholds)
        return MultiLabel(
            model=meta.name, iterations=meta.iterations, threshold=threshold, labels=passed,
            probabilities={name: float(p) for name, p in zip(meta.labels, probabilities, strict=True)},
            thresholds={name: float(t) for name, t in zip(meta.labels, thresholds, strict=True)},
        )  # fmt: skip

    async def explain(self, image: Upload, capsules: int) -> Explained:
        explainer = self.explainer
        if not has_routing(self.runtime):
            raise self.fail(501, f"{self.runtime.metadata.name} is a CNN without routing: there is no part-whole "
                                 "parse to explain; /explain needs a capsule network")  # fmt: skip
        if explainer is None:
            model = self.source.path
            raise self.fail(501, f"{self.settings.model} has no {EXPLAIN_ARTIFACT}: run `capserve export onnx "
                                 f"{model} -o {model / EXPLAIN_ARTIFACT} --explain` or serve with "
                                 "CAPSERVE_BACKEND=torch")  # fmt: skip
        meta = explainer.metadata
        pixels = await self.run(decode, image, explainer, self.settings.max_pixels)

        def run() -> Explanation:
            return explainer.explain(images.normalize_images(pixels[None], meta))

        explanation = await self.run(run)
        probabilities = softmax(explanation.logits)[0]  # (C,)
        c = int(probabilities.argmax())
        C = len(meta.labels)
        routing = explanation.part_whole[0, c]  # (H, W, I)
        _, W, I = routing.shape
        order = np.argsort(-routing.reshape(-1), kind="stable")[: min(capsules, routing.size)]
        top = [Capsule(type=int(k % I), row=int(k // (W * I)), col=int(k // I % W),
                       routing_probability=float(routing.flat[k]), vs_uniform=float(routing.flat[k] * C))
               for k in order]  # fmt: skip
        grid = routing.mean(axis=-1)  # (H, W)
        png = await self.run(heatmap_png, pixels, vs_uniform(grid, C))
        return Explained(
            model=meta.name, iterations=meta.iterations, prediction=top_labels(probabilities, meta.labels, 1)[0],
            uniform=1.0 / C, selectivity=selectivity(explanation.part_whole[0]), grid=grid.tolist(), capsules=top,
            heatmap_png=base64.b64encode(png).decode(),
        )  # fmt: skip

    def describe(self) -> dict[str, Any]:
        """GET /model: the served models (with their store tags), batching, limits, versions."""

        def model(runtime: Runtime | None, source: ModelSource | None) -> dict[str, Any] | None:
            if runtime is None:
                return None
            return {**asdict(runtime.metadata), "input_shape": list(runtime.metadata.input_shape),
                    "backend": runtime.backend, "providers": list(runtime.providers), "precision": runtime.precision,
                    "precision_reason": runtime.precision_reason,
                    "source": str(source.path) if source else None, "tag": source.tag if source else None}  # fmt: skip

        import bentoml

        s = self.settings
        return {
            "single_label": model(self.runtime, self.source),
            "multi_label": model(self.multilabel_runtime, self.multilabel_source),
            "explain": model(self.explainer, self.source),
            "batching": {
                "enabled": self.batching,
                "max_batch_size": s.max_batch_size,
                "max_latency_ms": s.max_latency_ms,
                "batches_in_flight": self.batches_in_flight(),
            },
            "limits": {"max_bytes": s.max_bytes, "max_pixels": s.max_pixels, "max_images": s.max_images},
            "versions": {"capserve": self.runtime.metadata.capserve_version, "bentoml": bentoml.__version__},
        }


# An upload at most this large decodes on the event loop under load (≈ 0.05–0.15 ms for a 32×32 to 64×64 PNG or
# JPEG), saving the hops to a worker thread and back: +10 % req/s on /multilabel at concurrency 32 (README "Where
# the time went", item 5). A larger one decodes in a worker thread, beside the event loop.
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
    batches_apart = settings.backend == "onnxruntime" and settings.device == "cpu" and settings.max_batch_size > 1
    return {"spinning": True} if batches_apart else {}


def batch_runtime(runtime: Runtime, settings: Settings) -> Runtime:
    """The runtime adaptive batches run on: for ONNX Runtime on a CPU, a second session of the same graph with the
    cores split between ``BATCHES_IN_FLIGHT`` batches (on 2 cores: one intra-op thread each), so that the next batch
    starts while one runs and no run waits on a peer thread descheduled by another; measured on this 2-core
    machine at concurrency 32, ≈ 10 % less CPU per request than one batch at a time on both cores (README "Where
    the time went"). Lone requests keep ``runtime`` and all its cores (the lowest latency). Other backends: itself.
    """
    if runtime.backend != "onnxruntime" or settings.device != "cpu":
        return runtime
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return load_runtime(runtime.path, "onnxruntime", settings.device, threads=max(1, cores // BATCHES_IN_FLIGHT))


ENDPOINTS = {False: "classify", True: "multilabel"}  # multilabel → the endpoint label of the batch-size metric
_BATCH_SIZE: list[Any] = []


def batch_size_histogram() -> Any:
    """BentoML's Prometheus histogram of adaptive batch sizes (created once, on first use)."""
    if not _BATCH_SIZE:
        import bentoml

        _BATCH_SIZE.append(bentoml.metrics.Histogram(
            name="capserve_batch_size", documentation="images per adaptive batch run for single-image requests",
            labelnames=["endpoint"], buckets=(1, 2, 4, 8, 16, 32, 64, 128),
        ))  # fmt: skip
    return _BATCH_SIZE[0]


NO_MULTILABEL_MODEL = (
    "no multi-label model is served: start the server with CAPSERVE_MULTILABEL_MODEL set to a "
    "multi_label model directory or model-store tag"
)
MULTILABEL_ROUTES = ("/multilabel", "/multilabel_logits")


def unavailable_routes(settings: Settings) -> dict[str, str]:
    """Routes this server answers with 501 before BentoML sees them, each with its how-to-fix message.

    The batchable ``/multilabel_logits`` runs in BentoML's batching task, outside the request, and BentoML replaces
    the message of a 5xx raised there with a generic one; answered here, the message reaches the client."""
    if settings.multilabel_model.strip().lower() == "none":
        return dict.fromkeys(MULTILABEL_ROUTES, NO_MULTILABEL_MODEL)
    return {}


def route_parameters(apis: Mapping[str, Any]) -> dict[str, frozenset[str]]:
    """Each BentoML API's route → its parameter names (the fields of its input model), for ``RequestGuard``."""
    return {api.route: frozenset(api.input_spec.model_fields) for api in apis.values()}


FILE_FIELDS = {"/classify": "image", "/classify_batch": "images", "/multilabel": "image", "/explain": "image"}
LIST_FIELDS = frozenset({"images"})  # file fields that take a list of images (the API's ``list[ImageFile]``)
