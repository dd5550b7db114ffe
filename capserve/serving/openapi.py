"""The OpenAPI document as a contract: BentoML's own ``/docs.json``, completed with what ``RequestGuard`` and the
routes really answer. Every route lists every status it can answer with the ``{"error": "..."}`` body, pixel tensors
say their element type, range and shape, file fields say ``image/*``, answers have the schemas of
``capserve.pipeline.schemas`` and ``capserve.serving.schemas`` (BentoML's inline copies drop ``null``), and API
keys appear as a bearer scheme.

BentoML 1.4.40 cannot declare any of it: its ``generate_spec`` (``_bentoml_sdk.service.openapi``) gives every API the
same 400, 404 and 500 of its own exception schemas, and ``@bentoml.api`` takes no responses, security scheme or
schema for a parameter. It also writes OpenAPI 3.0 with JSON Schema 2020-12 pieces from pydantic (``type: null``,
numeric ``exclusiveMinimum``, ``type: file``) that 3.0 validators reject; ``openapi_3_0`` rewrites them. Fixed
upstream when its ``/docs.json`` validates as OpenAPI 3.0 as it is (tests/serving/test_contract.py's fuzzer loads
it)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pydantic import TypeAdapter

from capserve.pipeline.schemas import Classification, Explained, MultiLabel
from capserve.serving.asgi import rewrite_response
from capserve.serving.routes import ARRAY_ROUTES, OPEN_ROUTES
from capserve.serving.schemas import ErrorBody, ServerDescription

__all__ = [
    "ANSWERS",
    "IMAGE_PART_TYPES",
    "ROUTE_STATUSES",
    "STATUS_REASONS",
    "contract",
    "contract_response",
    "openapi_3_0",
    "pixels_schema",
    "request_body",
    "responses",
]

# status → what it means, for every route that can answer it (README "Errors" has the long form)
STATUS_REASONS = {
    400: "a malformed request: an empty body or file, bytes that are not an image, a malformed multipart or JSON "
    "body, a parameter out of range or that the route does not have, pixels that are not uint8 (B, C, H, W) of "
    "the model's shape",
    401: "no API key, or not one of CAPSERVE_API_KEYS: send 'Authorization: Bearer KEY'",
    405: "a method the route does not answer",
    413: "a body over CAPSERVE_MAX_BYTES, an image over CAPSERVE_MAX_PIXELS, or more than CAPSERVE_MAX_IMAGES images",
    415: "a Content-Type the route does not take, or an image (file part or raw body) declared as a type that is not "
    "an image (an image is sent as image/*, application/octet-stream or without a Content-Type: its bytes decide)",
    422: "an image under 8 pixels a side, or pixels with no defined conversion",
    500: "a fault of the server, never of the request (its log has the traceback)",
    501: "the route's model (multi-label, or explanation graph) is not served by this server",
    503: "overloaded: adaptive batching expects the request to wait over CAPSERVE_MAX_LATENCY_MS: retry later",
}


# A file part's media types as OpenAPI 3.0 writes a list (encoding.contentType): what
# ``capserve.serving.bodies.maybe_image`` takes besides a part without one
IMAGE_PART_TYPES = "image/*, application/octet-stream"


# API route → the statuses it answers besides 200, 405 and 500 (and 401 when API keys are set)
ROUTE_STATUSES = {
    "/classify": (400, 413, 415, 422, 503),
    "/classify_batch": (400, 413, 415, 422),
    "/multilabel": (400, 413, 415, 422, 501, 503),
    "/explain": (400, 413, 415, 422, 501),
    "/logits": (400, 413, 415, 503),
    "/multilabel_logits": (400, 413, 415, 501, 503),
    "/model": (400, 413, 415),
}


# API route → the schema of its 200 answer
ANSWERS: dict[str, Any] = {
    "/classify": Classification,
    "/classify_batch": list[Classification],
    "/multilabel": MultiLabel,
    "/explain": Explained,
    "/model": ServerDescription,
}


def _schema(annotation: Any, definitions: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema of a pydantic type, its named parts moved into ``definitions`` (components/schemas)."""
    schema = TypeAdapter(annotation).json_schema(ref_template="#/components/schemas/{model}")
    definitions.update(schema.pop("$defs", {}))
    if "title" in schema and schema.get("type") == "object":  # a model: named, by reference
        definitions[schema["title"]] = schema
        return {"$ref": f"#/components/schemas/{schema['title']}"}
    return schema


def openapi_3_0(node: Any) -> Any:
    """``node`` with pydantic's JSON Schema 2020-12 spellings rewritten in OpenAPI 3.0's (recursively)."""
    if isinstance(node, list):
        return [openapi_3_0(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: openapi_3_0(value) for key, value in node.items()}
    options = node.get("anyOf")
    if isinstance(options, list) and {"type": "null"} in options:
        rest = [option for option in options if option != {"type": "null"}]
        del node["anyOf"]
        if len(rest) == 1 and "$ref" in rest[0]:
            node["allOf"] = rest  # 3.0 ignores siblings of $ref
        elif len(rest) == 1:
            node.update(rest[0])
        else:
            node["anyOf"] = rest
        node["nullable"] = True
    for bound, inclusive in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(node.get(bound), int | float) and not isinstance(node.get(bound), bool):
            node[inclusive], node[bound] = node[bound], True
    if node.get("type") == "file":
        node["type"], node["format"] = "string", "binary"
        node.pop("content_type", None)
    if node.get("type") == "null":  # a lone null (never a whole field in capserve's schemas)
        node.pop("type")
        node["nullable"] = True
    return node


def pixels_schema(shape: tuple[int, ...] | None) -> dict[str, Any]:
    """uint8 pixels (B, C, H, W) as nested JSON arrays; ``shape``: the model's (C, H, W) once it is loaded."""
    expected = f"(B, {', '.join(map(str, shape))})" if shape else "(B, C, H, W), (C, H, W) as in GET /model input_shape"
    schema: dict[str, Any] = {"type": "integer", "minimum": 0, "maximum": 255, "description": "a uint8 pixel"}
    for axis in "WHCB":
        schema = {"type": "array", "items": schema, "minItems": 1, "description": f"axis {axis}"}
    schema["description"] = (
        f"uint8 pixels {expected} as nested arrays of integers in [0, 255]; another shape is "
        "answered 400 with the shape expected"
    )
    if shape:
        schema["x-shape"] = ["B", *shape]
    return schema


def contract(
    document: dict[str, Any], secured: bool, input_shapes: Mapping[str, tuple[int, ...]], max_bytes: int
) -> dict[str, Any]:
    """BentoML's OpenAPI document → the contract: see the module's docstring. ``secured``: API keys are set."""
    from capserve import __version__

    definitions: dict[str, Any] = {}
    error = _schema(ErrorBody, definitions)
    document = openapi_3_0(document)
    document["info"] = {
        "title": "capserve",
        "version": __version__,
        "description": 'Capsule networks over HTTP. Every error answer is `{"error": "..."}`; '
        f"request bodies are limited to {max_bytes:,} bytes.",
    }
    paths = document.get("paths", {})
    for path, operations in paths.items():
        for operation in operations.values():
            if not isinstance(operation, dict) or "responses" not in operation:
                continue
            operation["responses"] = responses(path, operation, secured, error, definitions)
            request_body(path, operation, input_shapes)
            if secured:
                operation["security"] = [] if path in OPEN_ROUTES else [{"bearer": []}]
    if "/model" in paths and "post" in paths["/model"]:
        # RequestGuard answers GET /model as the parameterless POST it is
        get = {key: value for key, value in paths["/model"]["post"].items() if key != "requestBody"}
        paths["/model"] = {"get": {**get, "operationId": "capserve__model_get"}, **paths["/model"]}
    components = document.setdefault("components", {})
    components.setdefault("schemas", {}).update(openapi_3_0(definitions))
    if secured:
        components["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer", "description": "one of the keys in CAPSERVE_API_KEYS"}
        }
    return document


def responses(
    path: str, operation: dict[str, Any], secured: bool, error: dict[str, Any], definitions: dict[str, Any]
) -> dict[str, Any]:
    """``path``'s answers: 200 with its schema (``ANSWERS``; logits for the pixel-tensor routes), and every error
    status it can answer (``ROUTE_STATUSES``) with the ``{"error": "..."}`` body ``error``."""
    answers = {"200": operation["responses"].get("200", {"description": "Successful Response"})}
    statuses = (*ROUTE_STATUSES.get(path, ()), 405, 500)
    if secured and path not in OPEN_ROUTES:
        statuses = (401, *statuses)
    for status in sorted(statuses):
        answers[str(status)] = {
            "description": STATUS_REASONS[status],
            "content": {"application/json": {"schema": error}},
        }
    if path in ANSWERS:
        answers["200"] = {
            "description": "Successful Response",
            "content": {"application/json": {"schema": _schema(ANSWERS[path], definitions)}},
        }
    if path in ARRAY_ROUTES:
        logits = {"type": "array", "items": {"type": "number"}, "description": "logits of one image"}
        answers["200"] = {
            "description": "logits (B, classes), one row per image, in order",
            "content": {"application/json": {"schema": {"type": "array", "items": logits}}},
        }
    return answers


def request_body(path: str, operation: dict[str, Any], input_shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Complete ``operation``'s request body in place as RequestGuard takes it: pixel tensors of the model's shape,
    file parts of ``IMAGE_PART_TYPES``, no name that is not a parameter of the route."""
    if path in ARRAY_ROUTES:
        body = operation["requestBody"]["content"]["application/json"]["schema"]
        body["properties"]["images"] = pixels_schema(input_shapes.get(path))
    content = operation.get("requestBody", {}).get("content", {})
    if "application/json" in content:  # RequestGuard refuses a name that is not a parameter of the route
        content["application/json"]["schema"]["additionalProperties"] = False
    form = content.get("multipart/form-data")
    if form is None:
        return
    for name, field in form["schema"]["properties"].items():
        if field.get("format") == "binary" or field.get("items", {}).get("format") == "binary":
            # RequestGuard takes these and lets Pillow decide from the bytes (IMAGE_PART_TYPES)
            form.setdefault("encoding", {})[name] = {"contentType": IMAGE_PART_TYPES}
            field["description"] = (
                "an image file (PNG, JPEG, BMP, GIF, WebP…) sent as image/*, "
                "application/octet-stream or without a Content-Type: Pillow decides "
                "from the bytes (400 when they are not an image); a part declared as "
                "another type is answered 415"
            )
    form["schema"]["additionalProperties"] = False


def contract_response(send: Any, secured: bool, input_shapes: Mapping[str, tuple[int, ...]], max_bytes: int) -> Any:
    """An ASGI send() for ``GET /docs.json`` that replaces BentoML's document by ``contract``'s (errors unchanged)."""

    def rewrite(start: dict, body: bytes) -> tuple[dict, dict]:
        if start["status"] == 200:
            body = json.dumps(contract(json.loads(body), secured, input_shapes, max_bytes)).encode()
        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
        return (
            {**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]},
            {"type": "http.response.body", "body": body},
        )

    return rewrite_response(send, lambda start: True, rewrite)
