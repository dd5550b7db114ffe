"""Serving pieces that need no BentoML: settings, model loading, the ASGI request guard, result maths.

``service.py`` (the BentoML service) stays a thin layer over these.
"""

from __future__ import annotations

import io
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

import numpy as np

from capserve import images
from capserve.runtime import Runtime, RuntimeLoadError, load_runtime
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


def open_model(directory: str, settings: Settings) -> tuple[Runtime, Runtime | None]:
    """The runtime for predictions and the one for explanations (None when the directory has none)."""
    path = Path(directory)
    if not path.is_dir():
        raise ConfigurationError(f"model directory {path} not found (working directory {Path.cwd()}); set "
                                 "CAPSERVE_MODEL / CAPSERVE_MULTILABEL_MODEL to a directory made by "
                                 "`capserve train` or model.save(dir)")  # fmt: skip
    try:
        if settings.backend == "torch":
            runtime, _ = open_torch(path, settings.device, settings.iterations, settings.precision,
                                    settings.bf16_min_agreement)  # fmt: skip
            return runtime, runtime
        artifact = path / ARTIFACTS[settings.backend]
        if not artifact.is_file():
            fix = (f"capserve export onnx {path} -o {artifact}" if settings.backend == "onnxruntime"
                   else f"capserve export tensorrt {path / 'model.onnx'} -o {artifact}")  # fmt: skip
            raise ConfigurationError(f"{path} has no {artifact.name}, which the {settings.backend} backend "
                                     f"serves: run `{fix}` first, or set CAPSERVE_BACKEND=torch")  # fmt: skip
        runtime = load_runtime(artifact, settings.backend, settings.device)
        _, runtime.precision_reason = resolve_precision(settings.precision, settings.backend, settings.device)
        explainer = None
        if (path / EXPLAIN_ARTIFACT).is_file():
            explainer = load_runtime(path / EXPLAIN_ARTIFACT, "onnxruntime", settings.device)
            explainer.precision_reason = runtime.precision_reason
        else:
            log.warning(
                "%s has no %s: /explain is off (run `capserve export onnx %s -o %s --explain`)",
                path,
                EXPLAIN_ARTIFACT,
                path,
                path / EXPLAIN_ARTIFACT,
            )
        return runtime, explainer
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

    On the image routes, a raw ``image/*`` (or ``application/octet-stream``) body becomes the multipart form the
    API declares, with the query string's parameters as its other fields. A multipart body is parsed once
    here, so that malformed forms and file fields sent as text (which BentoML would fetch as URLs) get a 400,
    and any other content type gets a 415, instead of reaching BentoML's parser.
    """

    def __init__(self, app: Any, max_bytes: int, file_fields: Mapping[str, str], get_routes: tuple[str, ...] = ()):
        self.app, self.max_bytes, self.file_fields, self.get_routes = app, max_bytes, dict(file_fields), get_routes

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
        if scope["method"] == "GET" and scope["path"].rstrip("/") in self.get_routes:
            # BentoML APIs answer POST only; a GET on a parameterless API is the same call with an empty JSON body
            headers = self._replace_headers(scope["headers"], "application/json", 2)
            scope, receive = {**scope, "method": "POST", "headers": headers}, self._body_once(b"{}", receive)
            return await self.app(scope, receive, send)
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
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
                part_type = media if media.startswith("image/") else "image/unknown"  # the API declares image/*
                try:
                    body, content_type = self._to_multipart(body, field, part_type, scope.get("query_string", b""))
                except ValueError as e:
                    return await self._reply(send, 400, str(e))
                scope = {**scope, "headers": self._replace_headers(scope["headers"], content_type, len(body))}
            elif media == "multipart/form-data":
                error = await self._check_form(scope, body, field)
                if error:
                    return await self._reply(send, 400, error)
            elif not body:
                return await self._reply(send, 400, f"the request body is empty; send an image as the multipart "
                                                    f"file field {field!r} or as a raw image/* body")  # fmt: skip
            else:
                return await self._reply(send, 415, f"Content-Type {media or '(none)'!r} is not accepted here; send "
                                                    f"multipart/form-data with the file field {field!r}, or a raw "
                                                    "image/* body")  # fmt: skip
        return await self.app(scope, self._body_once(body, receive), send)

    def _too_large(self, size: int) -> str:
        return f"the request body is {size:,} bytes; the limit is {self.max_bytes:,} (CAPSERVE_MAX_BYTES)"

    @staticmethod
    async def _reply(send: Any, status: int, message: str) -> None:
        start, body = _json_response(status, message)
        await send(start)
        await send(body)

    @staticmethod
    def _to_multipart(data: bytes, field: str, part_type: str, query_string: bytes) -> tuple[bytes, str]:
        boundary = "capserve" + os.urandom(12).hex()
        parts = []
        for name, value in parse_qsl(query_string.decode("latin-1")):
            if not name.isidentifier() or "\r" in value or "\n" in value:
                raise ValueError(f"query parameter {name!r} is not a valid API parameter")
            if name != field:
                parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n')
        head = "".join(parts) + (f'--{boundary}\r\nContent-Disposition: form-data; name="{field}"; '
                                 f'filename="upload"\r\nContent-Type: {part_type}\r\n\r\n')  # fmt: skip
        body = head.encode("latin-1") + data + f"\r\n--{boundary}--\r\n".encode()
        return body, f"multipart/form-data; boundary={boundary}"

    @staticmethod
    def _replace_headers(raw: list, content_type: str, length: int) -> list:
        kept = [(k, v) for k, v in raw if k.lower() not in (b"content-type", b"content-length")]
        return [*kept, (b"content-type", content_type.encode()), (b"content-length", str(length).encode())]

    @staticmethod
    async def _check_form(scope: dict, body: bytes, field: str) -> str | None:
        from starlette.datastructures import UploadFile
        from starlette.requests import Request

        request = Request({k: v for k, v in scope.items() if k != "app"}, RequestGuard._body_once(body))
        try:
            form = await request.form()
        except Exception as e:  # starlette raises MultiPartException, or HTTPException when it knows the app
            return f"malformed multipart body: {getattr(e, 'detail', None) or getattr(e, 'message', None) or e}"
        try:
            values = form.getlist(field)
            if not values:
                return (f"the multipart body has no file field {field!r} (it has: "
                        f"{', '.join(sorted(set(form.keys()))) or 'nothing'})")  # fmt: skip
            if not all(isinstance(v, UploadFile) for v in values):
                return f"the field {field!r} must be a file upload, not text"
        finally:
            await form.close()
        return None


# ---------------------------------------------------------------------------- results


def softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(axis=-1, keepdims=True)  # (B, C)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def sigmoid(logits: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-logits))


# A perceptual blue → cyan → yellow → red ramp for the heat-map (no plotting library in the server).
RAMP = np.array([[49, 54, 149], [69, 117, 180], [116, 173, 209], [171, 217, 233], [254, 224, 144],
                 [253, 174, 97], [244, 109, 67], [215, 48, 39]], dtype=np.float32)  # fmt: skip


def heatmap_png(image: np.ndarray, grid: np.ndarray, scale: int = 8, alpha: float = 0.55) -> bytes:
    """A PNG of ``grid`` (h, w), min-max scaled and bilinearly upsampled, blended over ``image`` uint8 (C, H, W)."""
    from PIL import Image

    C, H, W = image.shape
    g = grid - grid.min()
    g = g / g.max() if g.max() > 0 else g  # (h, w) in [0, 1]
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
