"""``RequestGuard``, the ASGI middleware in front of BentoML: body-size limit (413), multipart parsed once and
checked (field names, media types, query parameters), and one JSON error shape ``{"error": "..."}`` for every
4xx/5xx."""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Mapping
from contextvars import ContextVar
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qsl

import numpy as np
from pydantic import WrapValidator

from capserve.serving.asgi import rewrite_response
from capserve.serving.openapi import contract_response
from capserve.serving.routes import ARRAY_ROUTES, OPEN_ROUTES

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------- request guard (ASGI)


def json_response(status: int, message: str) -> tuple[dict[str, Any], dict[str, Any]]:
    body = json.dumps({"error": message}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    start = {"type": "http.response.start", "status": status, "headers": headers}
    return start, {"type": "http.response.body", "body": body}


class RequestGuard:
    """ASGI middleware in front of BentoML: a body size limit (413) and the image routes' body formats.

    The image routes take a multipart form (the API's parameters, the image(s) as file fields; parameters may also
    be in the query string) or a raw image body with the other parameters in the query string. The body is parsed
    here, once: malformed forms and file fields sent as text (which BentoML would fetch as URLs) get a 400. An image
    (a raw body or a file part) declared as ``image/*``, ``application/octet-stream`` or nothing at all is taken, and
    its bytes decide (Pillow decodes them, or the request gets a 400): clients label files by their name, not their
    content. One declared as another type (``text/plain``, ``application/json``...) gets a 415. BentoML then receives
    the parameters as JSON, each image as a token for the bytes parsed here (``guarded_upload``), instead of parsing
    the form a second time and writing each upload to a temporary file for a ``Path`` parameter.

    ``input_shapes`` maps each pixel-tensor route to its model's (C, H, W): the service's ``Capsules.input_shapes``,
    in a mapping given here empty and filled once the models are loaded (BentoML builds its middleware before it
    creates the service instance). A route without one takes any (C, H, W).

    Works around BentoML 1.4.40, whose ``MultipartSerde`` (``_bentoml_impl.serde``) fetches a file field sent as
    text as a URL (``ensure_file``) and writes each upload to a temporary file; fixed upstream when that class takes
    neither step (watch ``ensure_file``).
    """

    def __init__(
        self,
        app: Any,
        max_bytes: int,
        file_fields: Mapping[str, str],
        get_routes: tuple[str, ...] = (),
        unavailable: Mapping[str, str] | None = None,
        list_fields: frozenset[str] = frozenset(),
        parameters: Mapping[str, frozenset[str]] | None = None,
        api_keys: tuple[str, ...] = (),
        array_routes: Mapping[str, bool] = ARRAY_ROUTES,
        input_shapes: Mapping[str, tuple[int, ...]] | None = None,
    ):
        self.app, self.max_bytes, self.file_fields, self.get_routes = app, max_bytes, dict(file_fields), get_routes
        self.unavailable = dict(unavailable or {})  # route → the 501 message (``unavailable_routes``)
        self.list_fields = list_fields  # file fields that take a list of images
        # route → its API's parameter names (``route_parameters``): any other name is a 400, not silently ignored
        self.parameters = dict(parameters or {})
        self.api_keys = tuple(key.encode() for key in api_keys)  # empty: every route is open
        # the pixel-tensor routes, and the (C, H, W) of their models once loaded (the mapping given, filled later)
        self.array_routes = array_routes
        self.input_shapes = input_shapes if input_shapes is not None else {}

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
        _request_error.set({})  # remember_error's, for this request
        send = one_error_shape(scope, send)
        path = scope["path"].rstrip("/") or "/"
        if self.api_keys and path not in OPEN_ROUTES:
            refused = self._unauthorized(scope["headers"])
            if refused:
                challenge = 'Bearer realm="capserve"' + (', error="invalid_token"' if "not valid" in refused else "")
                return await self._reply(send, 401, refused, [(b"www-authenticate", challenge.encode())])
        if scope["method"] == "GET" and path == "/docs.json":
            # BentoML's document, completed into the contract this guard enforces (capserve.serving.openapi)
            document = contract_response(
                send, secured=bool(self.api_keys), input_shapes=self.input_shapes, max_bytes=self.max_bytes
            )
            return await self.app(scope, receive, document)
        if scope["method"] == "GET" and path in self.get_routes:
            # BentoML 1.4.40 routes every API as POST only (``ServiceAppFactory.__call__``'s ``methods=["POST"]``);
            # a GET on a parameterless API is the same call with an empty JSON body. Fixed upstream once
            # ``@bentoml.api`` takes HTTP methods
            headers = self._replace_headers(scope["headers"], "application/json", 2)
            scope, receive = {**scope, "method": "POST", "headers": headers}, self._body_once(b"{}", receive)
            return await self.app(scope, receive, send)
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        if path in self.unavailable:
            return await self._reply(send, 501, self.unavailable[path])
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            declared = int(headers.get("content-length", "0"))
        except ValueError:
            return await self._reply(send, 400, "Content-Length is not an integer")
        if declared > self.max_bytes:
            return await self._reply(send, 413, self._too_large(declared))
        field = self.file_fields.get(path)
        media = headers.get("content-type", "").split(";")[0].strip().lower()
        json_route = field is None and path in self.parameters and scope["method"] == "POST"
        if json_route and media not in ("application/json", ""):
            # BentoML 1.4.40 would parse a multipart body without a boundary (500) or a pickle (its own 415) here;
            # fixed upstream when tests/serving/test_contract.py's test_json_routes_refuse_other_content_types
            # passes without this check
            return await self._reply(
                send, 415, f"Content-Type {media!r} is not accepted by {path}; send Content-Type: application/json"
            )
        if field is None and not json_route and "content-length" in headers:
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
        if json_route:
            # checked here, before BentoML: BentoML 1.4.40's batcher fails every request batched with a malformed
            # tensor or one of another shape (500); fixed upstream when tests/serving/test_contract.py's
            # test_malformed_pixels_amid_concurrent_good_ones_fail_alone passes without this check
            body, problem = self._checked_json(path, body)
            if problem:
                return await self._reply(send, 400, problem)
            headers_out = self._replace_headers(scope["headers"], "application/json", len(body))
            return await self.app({**scope, "headers": headers_out}, self._body_once(body, receive), send)
        if field is not None:
            if maybe_image(media):
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
                    return await self._reply(
                        send,
                        400,
                        f"{', '.join(twice)}: given in the form and in the query "
                        "string with different values; give it once",
                    )
                parameters = {**query, **parameters}
            elif not body:
                return await self._reply(
                    send,
                    400,
                    f"the request body is empty; send an image as the multipart "
                    f"file field {field!r} or as a raw image/* body",
                )
            else:
                return await self._reply(
                    send,
                    415,
                    f"Content-Type {media!r} is not accepted here; send "
                    f"multipart/form-data with the file field {field!r}, or a raw "
                    "image/* body",
                )
            known = self.parameters.get(path)
            unknown = sorted(set(parameters) - known) if known is not None else []
            if unknown:
                return await self._reply(
                    send,
                    400,
                    f"{', '.join(map(repr, unknown))}: not a parameter of "
                    f"{path} (its parameters: "
                    f"{', '.join(sorted(known - {field}))})",
                )
            uploads = {f"{UPLOAD_TOKEN}{i}": image for i, image in enumerate(images)}
            _uploads.set(uploads)
            tokens = list(uploads)
            parameters[field] = tokens if field in self.list_fields else tokens[0]
            body = json.dumps(parameters).encode()
            scope = {**scope, "headers": self._replace_headers(scope["headers"], "application/json", len(body))}
        return await self.app(scope, self._body_once(body, receive), send)

    def _unauthorized(self, raw_headers: list) -> str | None:
        """Why a request may not call this server (None: it sent one of the keys as ``Authorization: Bearer``).

        Every key is compared, in constant time (``hmac.compare_digest``), so that neither the timing nor which key
        matched tells a caller anything about the keys."""
        sent = [v for k, v in raw_headers if k.lower() == b"authorization"]
        if not sent:
            return "this server needs an API key: send the header 'Authorization: Bearer KEY'"
        scheme, _, token = sent[0].strip().partition(b" ")
        if scheme.lower() != b"bearer" or not token.strip():
            return "the Authorization header must be 'Bearer KEY'"
        token = token.strip()
        matched = False
        for key in self.api_keys:
            matched |= hmac.compare_digest(token, key)
        return None if matched else "the API key is not valid"

    def _checked_json(self, path: str, body: bytes) -> tuple[bytes, str | None]:
        """A JSON route's body (an empty one as ``{}``), or the reason it is refused: not a JSON object, a name that
        is not a parameter of the route, or pixels that are not a uint8 (B, C, H, W) tensor of the model's shape."""
        known = self.parameters.get(path, frozenset())
        if not body.strip():
            if not known:
                return b"{}", None
            return body, f"the request body is empty; send a JSON object with {', '.join(sorted(known))}"
        try:
            data = json.loads(body)
        except (ValueError, RecursionError) as e:
            return body, f"the request body is not valid JSON: {e}"
        if not isinstance(data, dict):
            return body, f"the request body must be a JSON object (with {', '.join(sorted(known)) or 'no fields'})"
        unknown = sorted(set(data) - known)
        if unknown:
            return body, (
                f"{', '.join(map(repr, unknown))}: not a parameter of {path} (its parameters: "
                f"{', '.join(sorted(known)) or 'none'})"
            )
        if path in self.array_routes:
            if "images" not in data:
                return body, "the JSON object has no 'images': send uint8 pixels (B, C, H, W) as nested arrays"
            problem = pixels_problem(data["images"], self.input_shapes.get(path))
            if problem:
                return body, problem
        return body, None

    def _too_large(self, size: int) -> str:
        return f"the request body is {size:,} bytes; the limit is {self.max_bytes:,} (CAPSERVE_MAX_BYTES)"

    @staticmethod
    async def _reply(send: Any, status: int, message: str, headers: list | None = None) -> None:
        start, body = json_response(status, message)
        start["headers"] += headers or []
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
                return 400, (
                    f"the multipart body has no file field {field!r} (it has: "
                    f"{', '.join(sorted(set(form.keys()))) or 'nothing'})"
                )
            if not all(isinstance(v, UploadFile) for v in values):
                return 400, f"the field {field!r} must be a file upload, not text"
            for value in values:
                part_type = (value.content_type or "").split(";")[0].strip().lower()
                if not maybe_image(part_type):
                    return 415, (
                        f"the file part {field!r} is declared as {part_type!r}, not an image; send it as "
                        "image/* (e.g. curl -F 'image=@cat.png;type=image/png'), application/octet-stream "
                        "or without a Content-Type"
                    )
            images = [await value.read() for value in values]
            parameters = {}
            for name in form:
                if name != field:
                    value = form[name]
                    parameters[name] = RequestGuard._value(
                        await value.read() if isinstance(value, UploadFile) else value
                    )
        finally:
            await form.close()
        return parameters, images


# what a client declares for a file it knows nothing about: curl for a name without a known extension, Python's
# requests for a plain file tuple (no Content-Type at all); Pillow then decides from the bytes
UNTYPED = ("application/octet-stream", "")


def maybe_image(media: str) -> bool:
    """Whether an upload declared as ``media`` (lower case, no parameters; "" when none) may hold an image, to be
    decided by its bytes; False for a declared type that is not an image (the 415)."""
    return media.startswith("image/") or media in UNTYPED


_JSON_TYPES = {dict: "object", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}


def pixels_problem(images: Any, shape: tuple[int, ...] | None) -> str | None:
    """Why ``images`` (a JSON value) is not uint8 pixels (B, C, H, W) with (C, H, W) = ``shape`` (None: any), or
    None when it is."""
    expected = f"(B, {', '.join(map(str, shape))})" if shape else "(B, C, H, W)"
    what = f"images must be integer pixels in [0, 255] of shape {expected}"
    if not isinstance(images, list):
        return f"{what}, as nested JSON arrays; got a JSON {_JSON_TYPES.get(type(images), type(images).__name__)}"
    try:
        pixels = np.asarray(images)  # (B, C, H, W)
    except (ValueError, TypeError, OverflowError, RecursionError):
        return f"{what}; got nested arrays of different lengths"
    if pixels.ndim != 4 or pixels.dtype == object:
        return f"{what}; got {'ragged arrays' if pixels.dtype == object else f'{pixels.ndim} dimensions'}"
    if pixels.size == 0:
        return f"{what}; got shape {pixels.shape}, which holds no pixels"
    if pixels.dtype.kind not in "iu":
        return f"{what}; got {pixels.dtype} values"
    if pixels.min() < 0 or pixels.max() > 255:
        return f"{what}; got values in [{pixels.min()}, {pixels.max()}]"
    if shape and pixels.shape[1:] != tuple(shape):
        return f"{what}; got shape {pixels.shape}"
    return None


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
        return "; ".join(
            f"{'.'.join(str(p) for p in d.get('loc', ())) or 'request'}: {d.get('msg', d)}" for d in details
        )
    message = data.get("error", data.get("detail", data))
    return message if isinstance(message, str) else json.dumps(message)


# 5xx statuses that are a documented state of the server, not a fault: a route whose model it was started without
# (501), a request shed by adaptive batching under overload (503, "retry later"). Logged as a warning, like a
# client's mistake; ERROR (and a traceback) stays for what needs an operator.
EXPECTED_SERVER_STATES = (501, 503)


def one_error_shape(scope: dict, send: Any) -> Any:
    """An ASGI send() that rewrites every error response to ``{"error": "..."}`` and logs it as one line
    (method, path, status, reason); other responses pass through untouched.

    Works around BentoML 1.4.40's ``ServiceAppFactory.api_endpoint_wrapper`` (``_bentoml_impl.server.app``),
    which answers a 4xx as a list ``[{"error": ...}]``, a validation error with ``detail``, and every 5xx with a
    generic message: a ``RequestError`` raised in this request (503, 501) gets its own back (``remember_error``).
    Fixed upstream when that function answers ``{"error": str(exc)}`` for every status (tests/serving's
    ``test_501_says_how_to_fix`` then passes without the rewrite)."""

    def rewrite(held_start: dict, held_body: bytes) -> tuple[dict, dict]:
        status = held_start["status"]
        known = _request_error.get() or {}
        reason = known.get("message") or error_message(status, held_body)  # BentoML hides 5xx messages
        level = logging.WARNING if status < 500 or status in EXPECTED_SERVER_STATES else logging.ERROR
        log.log(level, "%s %s %d %s", scope["method"], scope["path"], status, reason)
        start, body = json_response(status, reason)
        start["headers"] += [
            (k, v) for k, v in held_start.get("headers", []) if k.lower() not in (b"content-type", b"content-length")
        ]
        return start, body

    return rewrite_response(send, lambda start: start["status"] >= 400, rewrite)


# the message of the RequestError raised while serving the current request (set per request by RequestGuard)
_request_error: ContextVar[dict[str, str] | None] = ContextVar("capserve_request_error", default=None)


def remember_error(message: str) -> None:
    """Keep ``message`` as the reason of the current request's error answer, which BentoML replaces by a generic
    one for a 5xx (``one_error_shape`` puts it back). Outside a request through ``RequestGuard``: nothing."""
    known = _request_error.get()
    if known is not None:
        known["message"] = message


class QuietClientErrors(logging.Filter):
    """Drops BentoML's "Exception on PATH" ERROR record (with traceback) for client errors (4xx, validation) and the
    expected 501s and 503s: ``one_error_shape`` logs each of them as one line instead. Server errors keep their
    traceback.

    Works around BentoML 1.4.40's ``api_endpoint_wrapper``, which calls ``log_exception`` (ERROR, traceback) for
    every exception, 4xx included; fixed upstream when tests/serving/test_service.py's
    ``test_a_bad_request_logs_one_line`` passes without this filter."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if error is None:
            return True
        if type(error).__name__ == "ValidationError":  # pydantic's: the request's fields
            return False
        code = getattr(error, "error_code", None)
        return not (code is not None and (400 <= int(code) < 500 or int(code) in EXPECTED_SERVER_STATES))
