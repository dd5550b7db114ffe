"""``RequestGuard``, the ASGI middleware in front of BentoML, and the one error shape ``{"error": "..."}``.

What it adds to BentoML, each because BentoML 1.4.40 cannot do it (read in its source):

- API keys (401): open-source BentoML has no authentication setting; its security guide says to add an ASGI
  middleware, and ``api_endpoint_wrapper`` answers a 401 or 403 raised by an API as "Authorization error".
- The body-size limit (413): neither BentoML's configuration (``services.*``) nor the uvicorn server it starts
  (``_bentoml_impl.worker.service``) limits a body; an oversized upload is read whole before any API runs.
- One multipart parse, checked (400, 415): ``MultipartSerde`` fetches a file field sent as text as a URL
  (``ensure_file``) and writes each upload to a temporary file, and ``ContentType("image/*")`` answers a part sent
  as ``application/octet-stream`` (curl's label for a name without a known extension) with a 400.
- GET on parameterless APIs: BentoML routes every API as POST only, and ``@bentoml.api`` takes no HTTP method.
- JSON routes' media type and pixel tensors (415, 400): BentoML parses the body as whatever media type is declared
  (a multipart one without a boundary: a 500), and its batcher fails every request batched with a malformed
  tensor (500).
- One error shape (``one_error_shape``, ``QuietClientErrors``): ``api_endpoint_wrapper`` answers a 4xx as a list,
  a validation error with ``detail`` and every 5xx with a generic message, each logged with a traceback.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Mapping
from contextvars import ContextVar
from http import HTTPStatus
from typing import Any

from pydantic import WrapValidator

from capserve.serving.asgi import body_once, replace_headers, rewrite_response
from capserve.serving.bodies import (
    Refused,
    maybe_image,
    not_a_parameter,
    pixels_problem,
    query_parameters,
    read_form,
    with_query,
)
from capserve.serving.openapi import contract_response
from capserve.serving.routes import ARRAY_ROUTES, OPEN_ROUTES

__all__ = [
    "EXPECTED_SERVER_STATES",
    "GUARDED_UPLOAD",
    "UPLOAD_TOKEN",
    "QuietClientErrors",
    "RequestGuard",
    "error_message",
    "guarded_upload",
    "json_response",
    "one_error_shape",
    "remember_error",
]

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------- request guard (ASGI)


def json_response(status: int, message: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ASGI messages (start, body) of an answer ``{"error": message}`` with ``status``."""
    body = json.dumps({"error": message}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    start = {"type": "http.response.start", "status": status, "headers": headers}
    return start, {"type": "http.response.body", "body": body}


class RequestGuard:
    """ASGI middleware in front of BentoML: API keys (401), a body size limit (413), the image routes' body formats
    and the JSON routes' bodies (400, 415), and GET on parameterless APIs.

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

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        _request_error.set({})  # remember_error's, for this request
        send = one_error_shape(scope, send)
        try:
            await self._route(scope, receive, send)
        except Refused as refused:
            await self._reply(send, refused.status, refused.message, refused.headers)

    async def _route(self, scope: dict, receive: Any, send: Any) -> None:
        """One request's way through the guard: refused (``Refused``), passed on as it came, or passed on with its
        body checked and rewritten as the JSON BentoML reads."""
        path, method = scope["path"].rstrip("/") or "/", scope["method"]
        if self.api_keys and path not in OPEN_ROUTES:
            self._authorize(scope["headers"])
        if method == "GET" and path == "/docs.json":
            # BentoML's document, completed into the contract this guard enforces (capserve.serving.openapi)
            document = contract_response(
                send, secured=bool(self.api_keys), input_shapes=self.input_shapes, max_bytes=self.max_bytes
            )
            return await self.app(scope, receive, document)
        if method == "GET" and path in self.get_routes:
            # BentoML 1.4.40 routes every API as POST only (``ServiceAppFactory.routes``' ``methods=["POST"]``); a
            # GET on a parameterless API is the same call with an empty JSON body. Fixed upstream once
            # ``@bentoml.api`` takes HTTP methods
            scope = {**scope, "method": "POST", "headers": replace_headers(scope["headers"], "application/json", 2)}
            return await self.app(scope, body_once(b"{}", receive), send)
        if method not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        if path in self.unavailable:
            raise Refused(501, self.unavailable[path])
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        self._check_declared_length(headers)
        field = self.file_fields.get(path)
        media = headers.get("content-type", "").split(";")[0].strip().lower()
        json_route = field is None and path in self.parameters and method == "POST"
        if json_route and media not in ("application/json", ""):
            # BentoML 1.4.40 would parse a multipart body without a boundary (500) or a pickle (its own 415) here;
            # fixed upstream when tests/serving/test_contract.py's test_json_routes_refuse_other_content_types
            # passes without this check
            raise Refused(415, f"Content-Type {media!r} is not accepted by {path}; send Content-Type: application/json")
        if field is None and not json_route and "content-length" in headers:
            return await self.app(scope, receive, send)  # within the limit: nothing to check or rewrite
        body = await self._read_body(receive)
        if body is None:
            return None  # the client went away
        if json_route:
            body = self._checked_json(path, body)
        elif field is not None:
            body = json.dumps(await self._image_parameters(scope, path, field, media, body)).encode()
        else:
            return await self.app(scope, body_once(body, receive), send)  # counted within the limit, as it came
        scope = {**scope, "headers": replace_headers(scope["headers"], "application/json", len(body))}
        return await self.app(scope, body_once(body, receive), send)

    def _authorize(self, raw_headers: list) -> None:
        """Refuse (401, with a ``WWW-Authenticate`` challenge) a request without one of the keys."""
        reason = self._unauthorized(raw_headers)
        if reason:
            challenge = 'Bearer realm="capserve"' + (', error="invalid_token"' if reason == INVALID_KEY else "")
            raise Refused(401, reason, [(b"www-authenticate", challenge.encode())])

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
        return None if matched else INVALID_KEY

    def _check_declared_length(self, headers: Mapping[str, str]) -> None:
        """Refuse a body whose ``Content-Length`` is not an integer (400) or over the limit (413), unread."""
        try:
            declared = int(headers.get("content-length", "0"))
        except ValueError:
            raise Refused(400, "Content-Length is not an integer") from None
        if declared > self.max_bytes:
            raise Refused(413, self._too_large(declared))

    async def _read_body(self, receive: Any) -> bytes | None:
        """The whole body, counted against the limit as it arrives (413 once over it: a chunked body declares no
        length); None when the client disconnects first."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise Refused(413, self._too_large(size))
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _too_large(self, size: int) -> str:
        return f"the request body is {size:,} bytes; the limit is {self.max_bytes:,} (CAPSERVE_MAX_BYTES)"

    def _checked_json(self, path: str, body: bytes) -> bytes:
        """A JSON route's body (an empty one as ``{}``), or ``Refused`` (400): not a JSON object, a name that is not
        a parameter of the route, or pixels that are not a uint8 (B, C, H, W) tensor of the model's shape.

        Pixels are checked here, before BentoML: BentoML 1.4.40's batcher fails every request batched with a
        malformed tensor or one of another shape (500); fixed upstream when tests/serving/test_contract.py's
        test_malformed_pixels_amid_concurrent_good_ones_fail_alone passes without this check."""
        known = self.parameters.get(path, frozenset())
        if not body.strip():
            if not known:
                return b"{}"
            raise Refused(400, f"the request body is empty; send a JSON object with {', '.join(sorted(known))}")
        try:
            data = json.loads(body)
        except (ValueError, RecursionError) as e:
            raise Refused(400, f"the request body is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            fields = ", ".join(sorted(known)) or "no fields"
            raise Refused(400, f"the request body must be a JSON object (with {fields})")
        unknown = sorted(set(data) - known)
        if unknown:
            raise Refused(400, not_a_parameter(unknown, path, known))
        if path in self.array_routes:
            if "images" not in data:
                raise Refused(400, "the JSON object has no 'images': send uint8 pixels (B, C, H, W) as nested arrays")
            problem = pixels_problem(data["images"], self.input_shapes.get(path))
            if problem:
                raise Refused(400, problem)
        return body

    async def _image_parameters(self, scope: dict, path: str, field: str, media: str, body: bytes) -> dict[str, Any]:
        """An image route's parameters as BentoML receives them, from a raw image body or a multipart form and the
        query string; each image is a token for its bytes (kept for ``guarded_upload``). ``Refused`` (400, 415) when
        the body is empty, malformed or declared as something that is not an image."""
        query = scope.get("query_string", b"")
        if maybe_image(media):
            if not body:
                raise Refused(400, "the request body is empty; send an image")
            parameters, images = query_parameters(query, field), [body]
        elif media == "multipart/form-data":
            parameters, images = await read_form(scope, body, field)
            # parameters may come in the query string as well (``curl -F image=@x.png '…/classify?top_k=1'``)
            parameters = with_query(parameters, query_parameters(query, field))
        elif not body:
            raise Refused(
                400,
                f"the request body is empty; send an image as the multipart file field {field!r} or as a raw image/* "
                "body",
            )
        else:
            raise Refused(
                415,
                f"Content-Type {media!r} is not accepted here; send multipart/form-data with the file field "
                f"{field!r}, or a raw image/* body",
            )
        known = self.parameters.get(path)
        unknown = sorted(set(parameters) - known) if known is not None else []
        if unknown:
            raise Refused(400, not_a_parameter(unknown, path, known - {field}))
        uploads = {f"{UPLOAD_TOKEN}{i}": image for i, image in enumerate(images)}
        _uploads.set(uploads)
        tokens = list(uploads)
        parameters[field] = tokens if field in self.list_fields else tokens[0]
        return parameters

    @staticmethod
    async def _reply(send: Any, status: int, message: str, headers: list | None = None) -> None:
        start, body = json_response(status, message)
        start["headers"] += headers or []
        await send(start)
        await send(body)


INVALID_KEY = "the API key is not valid"


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
