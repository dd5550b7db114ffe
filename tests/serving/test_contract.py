"""The HTTP API as a contract, against a real ``bentoml serve`` of the checkout with API keys on: Schemathesis (an
OpenAPI fuzzer no one here wrote) finds no 5xx and nothing the document does not say; BentoML's own client calls
every route; API keys; pixel tensors refused before the batcher; the pixel limit under load below 64×64."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from support.models import tiny_model
from support.server import ROOT, encode, error_of, export, random_png, start_server, stop, upload, wait_ready

KEYS = ("first-key-0123456789", "second-key-abcdefghij")


AUTH = {"Authorization": f"Bearer {KEYS[1]}"}


MAX_PIXELS = 1000  # below the 64×64 pixels that are decoded on the event loop under load


THRESHOLDS = (0.3, 0.7) * 5


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> dict:
    """A server whose keys come from a file (``@FILE``), with a pixel limit of 1,000 (a 31×31 image passes)."""
    tmp = tmp_path_factory.mktemp("contract")
    models = {
        "cifar10": export(tiny_model("cifar10-resnet"), tmp / "cifar10", explain=True),
        "multimnist": export(tiny_model("multimnist-matrix-small", thresholds=THRESHOLDS), tmp / "multimnist", False),
    }
    (tmp / "keys").write_text(f"# API keys\n{KEYS[0]}\n\n{KEYS[1]}\n")
    proc, url, log = start_server(
        tmp,
        CAPSERVE_MODEL=str(models["cifar10"]),
        CAPSERVE_MULTILABEL_MODEL=str(models["multimnist"]),
        CAPSERVE_API_KEYS=f"@{tmp / 'keys'}",
        CAPSERVE_MAX_PIXELS=str(MAX_PIXELS),
        CAPSERVE_MAX_BATCH_SIZE="16",
        CAPSERVE_MAX_LATENCY_MS="30000",
        CAPSERVE_MAX_BYTES="300000",
    )
    try:
        wait_ready(proc, url, log)  # /readyz answers without a key
        yield {"url": url, "log": log, "tmp": tmp, "models": models}
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def client(served):
    with httpx.Client(base_url=served["url"], headers=AUTH, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def contract_schema(served):
    return schemathesis.openapi.from_url(f"{served['url']}/docs.json", headers=AUTH)


# every operation of the document (the test below fails when one appears or goes, so that it is fuzzed)
OPERATIONS = (
    "GET /healthz",
    "GET /livez",
    "GET /readyz",
    "GET /metrics",
    "POST /classify",
    "POST /classify_batch",
    "POST /explain",
    "POST /logits",
    "GET /model",
    "POST /model",
    "POST /multilabel",
    "POST /multilabel_logits",
)


def test_the_document_lists_every_operation(contract_schema):
    found = {f"{op.ok().method.upper()} {op.ok().path}" for op in contract_schema.get_all_operations()}
    assert found == set(OPERATIONS)


@pytest.mark.parametrize("label", OPERATIONS)
def test_the_fuzzer_finds_no_server_error_and_nothing_undocumented(contract_schema, label):
    """Schemathesis on each operation, 40 requests the document calls valid and 40 it calls invalid, with a fixed
    seed (``derandomize``): no 5xx, and every status, content type and answer as documented."""
    operation = contract_schema.find_operation_by_label(label)
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    # an open probe takes nothing that could be made invalid: no negative requests exist for it
    open_probe = label.split()[1] in ("/livez", "/readyz", "/metrics")
    for mode in (GenerationMode.POSITIVE,) if open_probe else (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

        @given(case=operation.as_strategy(mode))
        @settings(
            max_examples=40, derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck)
        )
        def fuzz(case) -> None:
            case.call_and_validate(headers=AUTH, checks=checks)

        fuzz()


def test_bentoml_client_calls_every_route(served, tmp_path):
    """BentoML's own client, built from the server's schema, calls every API route with the key."""
    import bentoml

    image = tmp_path / "image.png"
    image.write_bytes(random_png(1, (30, 30)))
    with bentoml.SyncHTTPClient(served["url"], token=KEYS[0], timeout=60) as bento:
        assert len(bento.classify(image=image, top_k=3)["predictions"]) == 3
        assert [len(r["predictions"]) for r in bento.classify_batch(images=[image, image], top_k=2)] == [2, 2]
        assert bento.multilabel(image=image, threshold=0.5)["threshold"] == 0.5
        assert bento.explain(image=image, capsules=4)["prediction"]["label"]
        assert np.asarray(bento.logits(images=np.zeros((2, 3, 32, 32), np.uint8))).shape == (2, 10)
        assert np.asarray(bento.multilabel_logits(images=np.zeros((1, 3, 36, 36), np.uint8))).shape == (1, 10)
        assert bento.model()["single_label"]["name"] == "cifar10-resnet"


def test_api_keys(served):
    url = served["url"]
    for headers, challenge in [
        ({}, 'Bearer realm="capserve"'),
        ({"Authorization": "Bearer wrong-key-0123456789"}, 'error="invalid_token"'),
        ({"Authorization": f"Basic {KEYS[0]}"}, 'Bearer realm="capserve"'),
    ]:
        for method, path, request in [
            ("POST", "/classify", upload(random_png(2, (30, 30)))),
            ("GET", "/model", {}),
            ("GET", "/docs.json", {}),
            ("GET", "/nothing", {}),
            ("POST", "/logits", {"json": {"images": [[[[0]]]]}}),
        ]:
            r = httpx.request(method, url + path, headers=headers, timeout=30, **request)
            assert r.status_code == 401, (path, r.text)
            assert challenge in r.headers["www-authenticate"] and error_of(r)
    for key in KEYS:
        r = httpx.get(f"{url}/model", headers={"Authorization": f"Bearer {key}"}, timeout=30)
        assert r.status_code == 200, r.text
    for path in ("/livez", "/readyz", "/metrics"):  # probes and scrapes stay open
        assert httpx.get(url + path, timeout=30).status_code == 200
    document = httpx.get(f"{url}/docs.json", headers=AUTH, timeout=30).json()
    assert document["components"]["securitySchemes"]["bearer"] == {
        "type": "http",
        "scheme": "bearer",
        "description": "one of the keys in CAPSERVE_API_KEYS",
    }
    assert document["paths"]["/classify"]["post"]["security"] == [{"bearer": []}]
    assert document["paths"]["/livez"]["get"]["security"] == []
    log = served["log"].read_text()
    assert "is open" not in log
    assert not any(key in log for key in KEYS), "a key was logged"


def test_the_document_states_errors_pixels_and_file_types(client):
    document = client.get("/docs.json").json()
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            statuses = ("405", "500") if path in ("/livez", "/readyz", "/metrics") else ("401", "405", "500")
            for status in statuses:
                assert status in operation["responses"], (method, path, status)
    for path in ("/classify", "/classify_batch", "/multilabel", "/explain", "/logits", "/multilabel_logits"):
        responses = document["paths"][path]["post"]["responses"]
        assert {"400", "413", "415"} <= set(responses)
        assert responses["400"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorBody"}
    assert "501" in document["paths"]["/multilabel"]["post"]["responses"]
    assert "503" in document["paths"]["/logits"]["post"]["responses"]
    images = document["paths"]["/logits"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    pixels = images["properties"]["images"]
    assert pixels["x-shape"] == ["B", 3, 32, 32] and "(B, 3, 32, 32)" in pixels["description"]
    assert pixels["items"]["items"]["items"]["items"] == {
        "type": "integer",
        "minimum": 0,
        "maximum": 255,
        "description": "a uint8 pixel",
    }
    form = document["paths"]["/classify_batch"]["post"]["requestBody"]["content"]["multipart/form-data"]
    assert form["encoding"]["images"] == {"contentType": "image/*, application/octet-stream"}
    threshold = document["paths"]["/multilabel"]["post"]["requestBody"]["content"]["multipart/form-data"]
    assert threshold["schema"]["properties"]["threshold"]["exclusiveMaximum"] is True  # OpenAPI 3.0's spelling


def test_model_description_names_no_host_path(client, served):
    text = client.get("/model").text
    assert str(served["tmp"]) not in text and str(ROOT) not in text and '"source"' not in text


GOOD_PIXELS = np.random.default_rng(3).integers(0, 256, (1, 3, 32, 32)).tolist()


MALFORMED = {
    "object": {"images": {}},
    "empty": {"images": []},
    "scalar-array": {"images": [0]},
    "another-shape": {"images": np.zeros((1, 3, 8, 8), int).tolist()},
    "ragged": {"images": [[[[1, 2], [3]]]]},
    "floats": {"images": np.full((1, 3, 32, 32), 0.5).tolist()},
    "out-of-range": {"images": np.full((1, 3, 32, 32), 256).tolist()},
    "no-images": {},
    "unknown-field": {"images": GOOD_PIXELS, "pixels": 1},
}


def test_malformed_pixels_amid_concurrent_good_ones_fail_alone(client, served):
    """Malformed tensors are refused before BentoML's batcher: one that reached it (a 0-d array, another shape)
    failed every request batched with it with a 500."""

    async def send_all() -> list[httpx.Response]:
        requests = [{"images": GOOD_PIXELS}] * 24
        for i, body in enumerate(MALFORMED.values()):
            requests.insert(2 + 3 * i, body)
        async with httpx.AsyncClient(base_url=served["url"], headers=AUTH, timeout=120) as c:
            return await asyncio.gather(*(c.post("/logits", json=body) for body in requests)), requests

    responses, requests = asyncio.run(send_all())
    expected = client.post("/logits", json={"images": GOOD_PIXELS}).json()
    for r, body in zip(responses, requests, strict=True):
        if body is requests[0] or body == {"images": GOOD_PIXELS}:
            assert r.status_code == 200, r.text
            np.testing.assert_allclose(r.json(), expected, atol=1e-5)
        else:
            assert r.status_code == 400, (body if len(str(body)) < 200 else list(body), r.text)
            assert "images" in error_of(r) or "not a parameter" in error_of(r)


@pytest.mark.parametrize(
    "path, request_",
    [
        ("/model", {"content": b"{}", "headers": {"content-type": "multipart/form-data"}}),
        ("/logits", {"content": b"{}", "headers": {"content-type": "multipart/form-data"}}),
        ("/logits", {"content": b"\x80\x03}q", "headers": {"content-type": "application/vnd.bentoml+pickle"}}),
        ("/multilabel_logits", {"content": b'{"images": [[[[1]]]]}', "headers": {"content-type": "text/plain"}}),
    ],
)
def test_json_routes_refuse_other_content_types(client, path, request_):
    r = client.post(path, **request_)
    assert r.status_code == 415, r.text
    assert "application/json" in error_of(r)


def test_json_routes_refuse_malformed_json(client):
    for body in (b"{", b"[1]", b'{"images": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"):
        r = client.post("/logits", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert error_of(r)


def test_wrong_methods_are_405(client):
    for method, path in [
        ("GET", "/classify"),
        ("DELETE", "/logits"),
        ("PUT", "/model"),
        ("POST", "/readyz"),
        ("PATCH", "/metrics"),
    ]:
        r = client.request(method, path, content=b'{"a": 1}')
        assert r.status_code == 405, (method, path, r.text)
        assert error_of(r)


def test_small_uploads_over_the_pixel_limit_get_413_under_load(served):
    """Under load, uploads up to 64×64 pixels decode on the event loop; with CAPSERVE_MAX_PIXELS=1,000 a 40×40
    image (1,600 pixels) is still over the limit, and a 30×30 one (900 pixels) within it."""
    small, over = encode(np.full((30, 30, 3), 40, np.uint8)), encode(np.full((40, 40, 3), 40, np.uint8))
    requests = [over if i % 3 == 0 else small for i in range(36)]

    async def send_all() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=served["url"], headers=AUTH, timeout=120) as c:
            return await asyncio.gather(*(c.post("/classify", **upload(d)) for d in requests))

    responses = asyncio.run(send_all())
    for r, data in zip(responses, requests, strict=True):
        if data is over:
            assert r.status_code == 413, r.text
            assert f"the limit is {MAX_PIXELS:,} pixels" in error_of(r)
        else:
            assert r.status_code == 200, r.text


def test_readme_error_table_has_401(served):
    """The README's error table says what the server answers without a key (the row tests/serving/test_service.py
    checks the table's completeness against)."""
    text = (ROOT / "README.md").read_text()
    table = text[text.index("| status | error |") :].split("\n\n")[0]
    (row,) = [line for line in table.splitlines() if line.startswith("| 401 |")]
    r = httpx.post(f"{served['url']}/classify", timeout=30)
    assert r.status_code == 401 and "CAPSERVE_API_KEYS" in row
