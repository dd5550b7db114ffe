"""Reading and checking the request bodies ``RequestGuard`` parses: multipart forms, query strings, image parts'
declared types and pixel tensors, each refusal a ``Refused`` with its status and message.

BentoML 1.4.40 cannot do these checks: its ``MultipartSerde`` (``_bentoml_impl.serde``) fetches a file field sent as
text as a URL and writes each upload to a temporary file, its ``ContentType`` validator answers an untyped or
``application/octet-stream`` image with a 400, and a pixel tensor of the wrong shape fails the whole adaptive batch
it joins (500).
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import parse_qsl

import numpy as np

from capserve.serving.asgi import body_once

__all__ = [
    "UNTYPED",
    "Refused",
    "check_image_part",
    "form_value",
    "maybe_image",
    "not_a_parameter",
    "pixels_problem",
    "query_parameters",
    "read_form",
    "with_query",
]


class Refused(Exception):
    """A request the guard answers itself, before BentoML sees it: the status, the message and extra headers."""

    def __init__(self, status: int, message: str, headers: list[tuple[bytes, bytes]] | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or []


def not_a_parameter(unknown: list[str], path: str, known: frozenset[str]) -> str:
    """The 400's message for names that are not parameters of ``path``, whose parameters are ``known``."""
    names, parameters = ", ".join(map(repr, unknown)), ", ".join(sorted(known)) or "none"
    return f"{names}: not a parameter of {path} (its parameters: {parameters})"


# ---------------------------------------------------------------------------- forms and query strings


def form_value(text: str | bytes) -> Any:
    """A form field or query parameter as BentoML reads it: JSON when it parses (``5``, ``0.3``), else text."""
    try:
        return json.loads(text)
    except ValueError:
        return text.decode("utf-8", "replace") if isinstance(text, bytes) else text


def query_parameters(query_string: bytes, field: str) -> dict[str, Any]:
    """The query string's parameters but the file ``field``; ``Refused`` (400) for a name or value no API takes."""
    parameters = {}
    for name, value in parse_qsl(query_string.decode("latin-1")):
        if not name.isidentifier() or "\r" in value or "\n" in value:
            raise Refused(400, f"query parameter {name!r} is not a valid API parameter")
        if name != field:
            parameters[name] = form_value(value)
    return parameters


def with_query(form: dict[str, Any], query: dict[str, Any]) -> dict[str, Any]:
    """The form's parameters and the query string's; ``Refused`` (400) for one given in both with different
    values."""
    twice = sorted(name for name in query if name in form and query[name] != form[name])
    if twice:
        raise Refused(
            400, f"{', '.join(twice)}: given in the form and in the query string with different values; give it once"
        )
    return {**query, **form}


async def read_form(scope: dict, body: bytes, field: str) -> tuple[dict[str, Any], list[bytes]]:
    """A multipart ``body``'s other fields (as BentoML reads them) and the file ``field``'s images; ``Refused``
    (400) for a malformed form, a missing file field or one sent as text, (415) for a part declared as a type that
    is not an image."""
    from starlette.datastructures import UploadFile
    from starlette.requests import Request

    request = Request({k: v for k, v in scope.items() if k != "app"}, body_once(body))
    try:
        form = await request.form()
    except Exception as e:  # starlette raises MultiPartException, or HTTPException when it knows the app
        reason = getattr(e, "detail", None) or getattr(e, "message", None) or e
        raise Refused(400, f"malformed multipart body: {reason}") from None
    try:
        values = form.getlist(field)
        if not values:
            found = ", ".join(sorted(set(form.keys()))) or "nothing"
            raise Refused(400, f"the multipart body has no file field {field!r} (it has: {found})")
        if not all(isinstance(v, UploadFile) for v in values):
            raise Refused(400, f"the field {field!r} must be a file upload, not text")
        for value in values:
            check_image_part(field, value.content_type)
        images = [await value.read() for value in values]
        parameters = {}
        for name in form:
            if name != field:
                value = form[name]
                parameters[name] = form_value(await value.read() if isinstance(value, UploadFile) else value)
    finally:
        await form.close()
    return parameters, images


def check_image_part(field: str, content_type: str | None) -> None:
    """``Refused`` (415) for a file part declared as a type that is not an image (``maybe_image``)."""
    part_type = (content_type or "").split(";")[0].strip().lower()
    if not maybe_image(part_type):
        raise Refused(
            415,
            f"the file part {field!r} is declared as {part_type!r}, not an image; send it as image/* (e.g. curl -F "
            "'image=@cat.png;type=image/png'), application/octet-stream or without a Content-Type",
        )


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
