"""What a user relies on at the service's edges, each exactly on its boundary and one step either side: a body of
exactly ``CAPSERVE_MAX_BYTES`` (only "over" is a 413), the bearer scheme in any case (RFC 7235), an API key of exactly
the minimum length, image parts that clients send untyped (decided by their bytes), and the 501 of a server started
by ``capserve serve MODEL``. One in-process service (``support.inprocess``: BentoML's app behind the request guard)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import struct
import zlib

import numpy as np
import pytest
from support.inprocess import in_process_service
from support.server import encode

from capserve.errors import ConfigurationError
from capserve.pipeline.errors import ErrorKind, RequestError
from capserve.serving.app import http_error
from capserve.serving.cli import server_environment
from capserve.serving.guard import QuietClientErrors, one_error_shape
from capserve.serving.openapi import IMAGE_PART_TYPES
from capserve.serving.settings import Settings

pytest.importorskip("onnxruntime")

MAX_BYTES = 4096
MIN_KEY = "k3y-8chr"  # exactly the shortest key the settings take
AUTH = {"Authorization": f"Bearer {MIN_KEY}"}
BOUNDARY = "capserve-boundary"


@pytest.fixture(scope="module")
def service(tiny_cifar10, tmp_path_factory):
    """As ``capserve serve MODEL`` starts it (no multi-label model), with a key of the minimum length."""
    env = server_environment(argparse.Namespace(model=str(tiny_cifar10), multilabel_model=None), {})
    with in_process_service(
        tmp_path_factory.mktemp("boundaries"),
        CAPSERVE_MODEL=env["CAPSERVE_MODEL"],
        CAPSERVE_MULTILABEL_MODEL=env["CAPSERVE_MULTILABEL_MODEL"],
        CAPSERVE_API_KEYS=MIN_KEY,
        CAPSERVE_MAX_BYTES=str(MAX_BYTES),
        CAPSERVE_MAX_BATCH_SIZE="1",
    ) as client:
        client.headers.update(AUTH)
        yield client


def png_of_size(size: int, seed: int = 0) -> bytes:
    """A valid 32×32 PNG of exactly ``size`` bytes: a text chunk before IEND pads it."""
    pixels = np.random.default_rng(seed).integers(80, 82, (32, 32, 3), dtype=np.uint8)
    base = encode(pixels)
    data = b"pad\0" + b"x" * (size - len(base) - 12 - 4)
    chunk = struct.pack(">I", len(data)) + b"tEXt" + data + struct.pack(">I", zlib.crc32(b"tEXt" + data))
    out = base[:-12] + chunk + base[-12:]
    assert len(out) == size
    return out


def multipart(parts: list[tuple[str | None, bytes]], field: str = "image") -> bytes:
    """A multipart body of file parts (Content-Type, bytes); None: a part without Content-Type, as Python's
    ``requests`` sends a plain file tuple."""
    out = b""
    for content_type, data in parts:
        out += f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="{field}"; filename="upload"\r\n'.encode()
        if content_type is not None:
            out += f"Content-Type: {content_type}\r\n".encode()
        out += b"\r\n" + data + b"\r\n"
    return out + f"--{BOUNDARY}--\r\n".encode()


FORM = {"content-type": f"multipart/form-data; boundary={BOUNDARY}"}


# ------------------------------------------------------------------------------------------ CAPSERVE_MAX_BYTES


def test_a_body_of_exactly_max_bytes_is_served_and_one_byte_more_is_413(service):
    """The docs: a body *over* CAPSERVE_MAX_BYTES gets a 413. Declared (Content-Length) and counted (chunked)."""
    for size, status in ((MAX_BYTES - 1, 200), (MAX_BYTES, 200), (MAX_BYTES + 1, 413)):
        image = png_of_size(size)
        declared = service.post("/classify", content=image, headers={"content-type": "image/png"})
        assert declared.status_code == status, (size, declared.text)
        chunked = service.post(
            "/classify", content=iter([image[:1000], image[1000:]]), headers={"content-type": "image/png"}
        )
        assert "content-length" not in chunked.request.headers
        assert chunked.status_code == status, (size, chunked.text)
        if status == 413:
            assert f"the limit is {MAX_BYTES:,}" in declared.json()["error"]
    overhead = len(multipart([("image/png", b"")]))
    for size, status in ((MAX_BYTES, 200), (MAX_BYTES + 1, 413)):  # the whole multipart body counts
        body = multipart([("image/png", png_of_size(size - overhead))])
        assert len(body) == size
        assert service.post("/classify", content=body, headers=FORM).status_code == status, size


# ------------------------------------------------------------------------------------------ API keys


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER", "bEaReR"])
def test_the_bearer_scheme_is_case_insensitive(service, scheme):
    r = service.get("/model", headers={"Authorization": f"{scheme} {MIN_KEY}"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("header", ["Basic k3y-8chr", "Bearerk3y-8chr", "Bearer", "bearer k3y-8ch", "k3y-8chr"])
def test_other_schemes_and_near_keys_are_401(service, header):
    r = service.get("/model", headers={"Authorization": header})
    assert r.status_code == 401, r.text
    assert 'Bearer realm="capserve"' in r.headers["www-authenticate"]


def test_an_api_key_of_exactly_the_minimum_length_is_taken_and_one_shorter_refused(tmp_path):
    assert Settings.from_env({"CAPSERVE_API_KEYS": MIN_KEY}).api_keys == (MIN_KEY,)
    assert Settings.from_env({"CAPSERVE_API_KEYS": MIN_KEY + "9"}).api_keys == (MIN_KEY + "9",)
    (tmp_path / "keys").write_text(f"{MIN_KEY}\n")
    assert Settings.from_env({"CAPSERVE_API_KEYS": f"@{tmp_path / 'keys'}"}).api_keys == (MIN_KEY,)
    with pytest.raises(ConfigurationError, match="key 1 has 7 characters") as e:
        Settings.from_env({"CAPSERVE_API_KEYS": MIN_KEY[:-1]})
    assert "at least 8" in str(e.value) and MIN_KEY[:-1] not in str(e.value)


def test_a_server_started_with_a_key_of_the_minimum_length_answers_it(service):
    assert service.get("/model").status_code == 200
    assert service.get("/model", headers={"Authorization": f"Bearer {MIN_KEY}x"}).status_code == 401


# ------------------------------------------------------------------------------------------ image parts


@pytest.mark.parametrize("declared", [None, "application/octet-stream", "image/png", "image/jpeg"])
def test_an_image_part_sent_untyped_or_mistyped_is_decided_by_its_bytes(service, declared):
    """curl sends a file without a known extension as application/octet-stream, Python's requests a plain file
    tuple without a Content-Type: an image either way, and the answer is the one the PNG gets."""
    image = png_of_size(1500, seed=3)
    expected = service.post("/classify?top_k=10", content=image, headers={"content-type": "image/png"})
    assert expected.status_code == 200, expected.text
    r = service.post("/classify?top_k=10", content=multipart([(declared, image)]), headers=FORM)
    assert r.status_code == 200, r.text
    assert r.json() == expected.json()
    batch = multipart([(declared, image), ("image/png", image)], field="images")
    r = service.post("/classify_batch?top_k=10", content=batch, headers=FORM)
    assert r.status_code == 200, r.text
    assert r.json() == [expected.json()] * 2


@pytest.mark.parametrize("declared", [None, "application/octet-stream", "image/png"])
def test_an_untyped_part_that_is_not_an_image_is_400(service, declared):
    r = service.post("/classify", content=multipart([(declared, b"hello, world" * 10)]), headers=FORM)
    assert r.status_code == 400, r.text
    assert "the image:" in r.json()["error"]


@pytest.mark.parametrize("declared", ["text/plain", "application/json", "application/pdf", "video/mp4"])
def test_a_part_declared_as_another_type_is_415_even_holding_an_image(service, declared):
    r = service.post("/classify", content=multipart([(declared, png_of_size(1500))]), headers=FORM)
    assert r.status_code == 415, r.text
    error = r.json()["error"]
    assert declared in error and "application/octet-stream" in error and "image/*" in error


def test_a_raw_body_without_a_content_type_is_decided_by_its_bytes(service):
    image = png_of_size(1500, seed=3)
    typed = service.post("/classify", content=image, headers={"content-type": "image/png"})
    untyped = service.post("/classify", content=image)
    assert "content-type" not in untyped.request.headers
    assert untyped.status_code == 200, untyped.text
    assert untyped.json() == typed.json()
    assert service.post("/classify", content=b"not an image" * 10).status_code == 400
    assert service.post("/classify", content=image, headers={"content-type": "text/plain"}).status_code == 415


def test_the_document_says_which_part_types_are_taken(service):
    document = service.get("/docs.json").json()
    form = document["paths"]["/classify"]["post"]["requestBody"]["content"]["multipart/form-data"]
    assert form["encoding"]["image"] == {"contentType": IMAGE_PART_TYPES} and "application/octet-stream" in (
        IMAGE_PART_TYPES
    )
    assert "without a Content-Type" in form["schema"]["properties"]["image"]["description"]
    reason = document["paths"]["/classify"]["post"]["responses"]["415"]["description"]
    assert "application/octet-stream" in reason and "without a Content-Type" in reason


def test_the_document_names_the_unfamiliarity_of_every_answer(service):
    """The fields every answer carries (docs/unfamiliar.md) are in the OpenAPI document, described, and optional:
    clients generated from it keep working against a model without a calibration."""
    schemas = service.get("/docs.json").json()["components"]["schemas"]
    for name in ("Classification", "MultiLabel", "Explained"):
        properties, required = schemas[name]["properties"], schemas[name].get("required", [])
        assert "unlike the images the model learned" in properties["unfamiliarity"]["description"], name
        assert "unfamiliar" in properties and not {"unfamiliarity", "unfamiliar"} & set(required), name


# ------------------------------------------------------------------------------------------ 501


def test_the_501_of_capserve_serve_model_names_the_option_and_the_variable(service, caplog):
    """``capserve serve MODEL`` serves no multi-label model: /multilabel's 501 says how to start one with the
    command the user typed as well as with the variable, and is logged as the expected state it is, not as an
    error."""
    requests = [
        ("/multilabel", {"content": png_of_size(1500), "headers": {"content-type": "image/png"}}),
        ("/multilabel_logits", {"json": {"images": np.zeros((1, 3, 36, 36), int).tolist()}}),
    ]
    with caplog.at_level(logging.INFO):
        for path, request in requests:
            r = service.post(path, **request)
            assert r.status_code == 501, r.text
            error = r.json()["error"]
            assert "capserve serve MODEL --multilabel-model" in error and "CAPSERVE_MULTILABEL_MODEL=" in error
    lines = [line for line in caplog.records if line.name.startswith("capserve") and " 501 " in line.getMessage()]
    assert len(lines) == 2 and all(record.levelno == logging.WARNING for record in lines)
    assert not [record for record in caplog.records if record.levelno >= logging.ERROR]


def http_error_record(kind: ErrorKind | None) -> logging.LogRecord:
    """BentoML's "Exception on PATH" record of a refusal of ``kind`` (``http_error``); None: of a server fault."""
    from bentoml.exceptions import InternalServerError

    error = http_error(RequestError(kind, "x")) if kind is not None else InternalServerError("x")
    return logging.LogRecord(
        "bentoml", logging.ERROR, __file__, 1, "Exception on /explain", None, (type(error), error, None)
    )


def test_bentoml_traceback_is_dropped_for_501_and_503_and_kept_for_500():
    """A 501 raised in a request (/explain without its graph) and a 503 (a request shed under overload) are logged
    as one line by the guard; BentoML's traceback is kept for real faults."""
    quiet = QuietClientErrors()
    assert not quiet.filter(http_error_record(ErrorKind.UNAVAILABLE))
    assert not quiet.filter(http_error_record(ErrorKind.BAD_INPUT))
    assert not quiet.filter(http_error_record(ErrorKind.BUSY))
    assert quiet.filter(http_error_record(None))


@pytest.mark.parametrize(("status", "level"), [(503, logging.WARNING), (501, logging.WARNING), (500, logging.ERROR)])
def test_a_shed_request_is_a_warning_and_a_fault_an_error(status, level, caplog):
    """A 503 (adaptive batching sheds a request under overload: "retry later") is an expected, handled state of the
    server, logged as one WARNING line like a 501; a 500 is a fault, logged as an ERROR."""
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def answer() -> None:
        shaped = one_error_shape({"method": "POST", "path": "/classify"}, send)
        await shaped({"type": "http.response.start", "status": status, "headers": []})
        await shaped({"type": "http.response.body", "body": b'{"error": "retry later"}'})

    with caplog.at_level(logging.INFO):
        asyncio.run(answer())
    (record,) = [r for r in caplog.records if r.name.startswith("capserve")]
    assert record.levelno == level and record.getMessage() == f"POST /classify {status} retry later"
    assert sent[0]["status"] == status and json.loads(sent[1]["body"]) == {"error": "retry later"}
