"""The HTTP service against one real ``bentoml serve`` of tiny random-weight models: answers equal eager torch
(predictions, batches, multi-label thresholds, the routing parse and the occlusion map of ``/explain``), every README
error row, start-up failures, the model store and the built bentos."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from support.images import png_header_only
from support.models import tiny_model
from support.server import (
    BENTOML,
    MAX_BYTES,
    MAX_IMAGES,
    MAX_PIXELS,
    ROOT,
    eager_logits,
    encode,
    error_of,
    export,
    failed_start,
    random_png,
    requests_total,
    softmax,
    start_server,
    stop,
    upload,
    wait_ready,
)

import capserve
from capserve.data.images import preprocess
from capserve.errors import ConfigurationError
from capserve.hashing import file_sha256
from capserve.runtime import load_runtime
from capserve.serving.settings import Settings

THRESHOLDS = (0.3, 0.7) * 5


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("models")
    return {
        "cifar10": export(tiny_model("cifar10-resnet"), tmp / "cifar10", explain=True),
        "multimnist": export(tiny_model("multimnist-matrix-small", thresholds=THRESHOLDS), tmp / "multimnist", False),
    }


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("server")
    (tmp / "tmp").mkdir()
    proc, url, log = start_server(
        tmp,
        TMPDIR=str(tmp / "tmp"),  # where BentoML would write uploads for Path parameters
        CAPSERVE_MODEL=str(models["cifar10"]),
        CAPSERVE_MULTILABEL_MODEL=str(models["multimnist"]),
        CAPSERVE_MAX_BYTES=str(MAX_BYTES),
        CAPSERVE_MAX_PIXELS=str(MAX_PIXELS),
        CAPSERVE_MAX_IMAGES=str(MAX_IMAGES),
        CAPSERVE_MAX_BATCH_SIZE="16",
        CAPSERVE_MAX_LATENCY_MS="30000",
    )
    try:
        wait_ready(proc, url, log)
        with httpx.Client(base_url=url, timeout=60) as client:
            client.log_path, client.tmp, client.pid = log, tmp, proc.pid  # for the log and second-server tests
            yield client
    finally:
        stop(proc)
    assert proc.returncode is not None


@pytest.fixture
def server_log(server) -> Path:
    return server.log_path


@pytest.fixture(scope="module")
def eager(models) -> dict[str, capserve.CapsNet]:
    return {name: capserve.load(path) for name, path in models.items()}


# ------------------------------------------------------------------------------------------ predictions


@pytest.mark.parametrize(
    "data",
    [
        random_png(0),
        random_png(1, (50, 40)),
        random_png(2, (32, 32), "L"),
        encode(np.full((40, 64, 3), 90, np.uint8), "JPEG"),
    ],
    ids=["png", "png-50x40", "gray", "jpeg"],
)
def test_classify_equals_eager_pytorch(server, eager, data):
    r = server.post("/classify", **upload(data), data={"top_k": "10"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "cifar10-resnet" and body["iterations"] == 2
    expected = softmax(eager_logits(eager["cifar10"], data))
    got = np.zeros(10)
    for p in body["predictions"]:
        got[p["index"]] = p["probability"]
    np.testing.assert_allclose(got, expected, atol=1e-5)
    assert [p["index"] for p in body["predictions"]] == list(np.argsort(-got, kind="stable"))


def test_raw_body_and_top_k(server):
    data = random_png(3)
    multipart = server.post("/classify", **upload(data), data={"top_k": "3"}).json()
    raw = server.post("/classify?top_k=3", content=data, headers={"content-type": "image/png"})
    assert raw.status_code == 200, raw.text
    assert raw.json() == multipart and len(multipart["predictions"]) == 3
    # a multipart upload with its parameters in the query string (it counts: not the default five predictions)
    mixed = server.post("/classify?top_k=3", **upload(data))
    assert mixed.status_code == 200, mixed.text
    assert mixed.json() == multipart
    same_twice = server.post("/classify?top_k=3", **upload(data), data={"top_k": "3"})
    assert same_twice.status_code == 200 and same_twice.json() == multipart


def test_a_bad_image_in_a_batch_is_named_by_its_position(server):
    files = [("images", ("a.png", random_png(1), "image/png")), ("images", ("b.png", b"not an image", "image/png"))]
    r = server.post("/classify_batch", files=files)
    assert r.status_code == 400, r.text
    assert "image 1" in r.text and "tmp" not in r.text  # not BentoML's temporary file name


def test_classify_batch_in_order(server):
    datas = [random_png(10 + i) for i in range(5)]
    r = server.post("/classify_batch", files=[("images", (f"{i}.png", d, "image/png")) for i, d in enumerate(datas)])
    assert r.status_code == 200, r.text
    singles = [server.post("/classify", **upload(d)).json() for d in datas]
    batch = r.json()
    assert len(batch) == 5
    for b, s in zip(batch, singles, strict=True):
        assert [p["index"] for p in b["predictions"]] == [p["index"] for p in s["predictions"]]
        np.testing.assert_allclose(
            [p["probability"] for p in b["predictions"]], [p["probability"] for p in s["predictions"]], atol=1e-6
        )


def test_multilabel_thresholds(server, eager):
    data = encode(np.random.default_rng(5).integers(0, 256, (36, 36, 3), dtype=np.uint8))
    body = server.post("/multilabel", **upload(data)).json()
    probabilities = 1 / (1 + np.exp(-eager_logits(eager["multimnist"], data)))
    np.testing.assert_allclose([body["probabilities"][str(d)] for d in range(10)], probabilities, atol=1e-5)
    assert body["thresholds"] == {str(d): t for d, t in enumerate(THRESHOLDS)}
    expected = {str(d) for d in range(10) if probabilities[d] >= THRESHOLDS[d]}
    assert {label["label"] for label in body["labels"]} == expected
    assert 0 < len(expected) < 10  # the per-class thresholds split this model's near-0.5 outputs
    for threshold in (0.01, 0.99):
        chosen = server.post(f"/multilabel?threshold={threshold}", content=data, headers={"content-type": "image/png"})
        assert {label["label"] for label in chosen.json()["labels"]} == {
            str(d) for d in range(10) if probabilities[d] >= threshold
        }


def test_explain_matches_the_routing_trace(server, eager):
    data = random_png(6)
    r = server.post("/explain", **upload(data), data={"capsules": "5"})
    assert r.status_code == 200, r.text
    body = r.json()
    model = eager["cifar10"]
    with torch.inference_mode():
        trace = model.trace(torch.from_numpy(preprocess(data, model.config)))
    c = int(trace.logits[0].argmax())
    assert body["prediction"]["index"] == c
    whole = trace.part_whole()[0].numpy()  # (C, H, W, I)
    parse = whole[c]  # (H, W, I)
    assert body["uniform"] == pytest.approx(0.1)
    for capsule in body["capsules"]:
        expected = parse[capsule["row"], capsule["col"], capsule["type"]]
        assert capsule["routing_probability"] == pytest.approx(expected, abs=1e-5)
        assert capsule["vs_uniform"] == pytest.approx(expected * 10, abs=1e-4)
    assert body["capsules"][0]["routing_probability"] == pytest.approx(parse.max(), abs=1e-5)
    assert len(body["capsules"]) == 5
    np.testing.assert_allclose(body["grid"], parse.mean(axis=-1), atol=1e-5)
    entropy = -(whole * np.log(whole)).sum(axis=0) / np.log(10)  # (H, W, I): 1 where a capsule routes uniformly
    assert body["selectivity"] == pytest.approx(1 - entropy.mean(), abs=1e-4)
    heatmap = Image.open(io.BytesIO(base64.b64decode(body["heatmap_png"])))
    assert heatmap.format == "PNG" and heatmap.size == (256, 256)


def test_explain_occlusion_follows_the_model_as_each_window_is_greyed(server, eager):
    """The occlusion map equals eager torch's log-odds of the predicted class with each window greyed, computed here
    from the windows the answer names; its cost is the documented 4² + 1 forward passes."""
    data = random_png(7)
    body = server.post("/explain", **upload(data)).json()
    occlusion = body["occlusion"]
    model = eager["cifar10"]
    pixels = np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).transpose(2, 0, 1)  # (C, H, W): already 32×32
    grey = np.round(np.asarray(model.config.mean) * 255).astype(np.uint8)
    w, starts = occlusion["window"], occlusion["starts"]
    assert w == 8 and starts == [0, 8, 16, 24] and occlusion["forward_passes"] == 17
    copies = [pixels]
    for r in starts:
        for c in starts:
            copy = pixels.copy()
            copy[:, r : r + w, c : c + w] = grey[:, None, None]
            copies.append(copy)
    x = (np.stack(copies).astype(np.float32) / 255 - np.asarray(model.config.mean, np.float32)[:, None, None]) / (
        np.asarray(model.config.std, np.float32)[:, None, None]
    )
    with torch.inference_mode():
        z = model(torch.from_numpy(x)).double().numpy()  # (17, C)
    c = body["prediction"]["index"]
    assert int(z[0].argmax()) == c
    log_odds = z[:, c] - np.log(np.exp(np.delete(z, c, axis=1)).sum(axis=1))  # (17,)
    assert occlusion["log_odds"] == pytest.approx(log_odds[0], abs=1e-3)
    np.testing.assert_allclose(occlusion["drop"], (log_odds[0] - log_odds[1:]).reshape(4, 4), atol=1e-3)
    np.testing.assert_allclose(occlusion["probabilities"], (1 / (1 + np.exp(-log_odds[1:]))).reshape(4, 4), atol=1e-5)
    overlay = Image.open(io.BytesIO(base64.b64decode(occlusion["heatmap_png"])))
    assert overlay.format == "PNG" and overlay.size == (256, 256)


def test_the_occlusion_map_is_drawn_on_a_fixed_scale():
    """No drop leaves the image as it is; a window whose greying takes away the whole margin is full red; a drop that
    is small against the margin stays faint (never stretched to full colour), a quarter of it shows at half strength."""
    from capserve.pipeline.explain import RAMP, Occlusion, occlusion_png

    image = np.full((3, 4, 4), 100, np.uint8)

    def colours(drop: float) -> np.ndarray:
        occluded = Occlusion(3, 0.99, 6.0, 4, [0], np.zeros((1, 1)), np.full((1, 1), drop), np.full((4, 4), drop), 2)
        return np.asarray(Image.open(io.BytesIO(occlusion_png(image, occluded, scale=1, alpha=1.0))), dtype=float)

    np.testing.assert_allclose(colours(0.0), 100, atol=1)
    np.testing.assert_allclose(colours(6.0)[0, 0], RAMP[-1], atol=1)
    faint = colours(0.006)[0, 0]  # a thousandth of the margin: √0.001 ≈ 3 % of full strength
    assert np.abs(faint - 100).max() < 0.05 * 255, faint
    half = colours(1.5)[0, 0]  # a quarter of the margin: half strength
    np.testing.assert_allclose(half, 0.5 * 100 + 0.5 * RAMP[5], atol=1)  # half way along pale (RAMP[3]) → red


def test_heatmap_has_a_fixed_scale_relative_to_uniform():
    """The shipped CIFAR-10 model's grid spans 0.0998-0.1013 for 10 classes: it must look uniform (pale), not be
    stretched to full colour; routing four times uniform is full red, a quarter is full blue."""
    from capserve.pipeline.explain import RAMP, heatmap_png, selectivity

    image = np.zeros((3, 4, 4), np.uint8)

    def colours(grid: np.ndarray) -> np.ndarray:
        png = heatmap_png(image, grid, scale=1, alpha=1.0)
        return np.asarray(Image.open(io.BytesIO(png)), dtype=float).reshape(-1, 3)

    near_uniform = np.linspace(0.998, 1.013, 16).reshape(4, 4)  # × uniform
    spread = colours(near_uniform).max(axis=0) - colours(near_uniform).min(axis=0)
    assert spread.max() < 12, spread  # one pale colour, not blue-to-red
    middle = (RAMP[3] + RAMP[4]) / 2
    np.testing.assert_allclose(colours(np.ones((4, 4))), np.tile(middle, (16, 1)), atol=1)
    np.testing.assert_allclose(colours(np.full((4, 4), 4.0))[0], RAMP[-1], atol=1)
    np.testing.assert_allclose(colours(np.full((4, 4), 0.25))[0], RAMP[0], atol=1)
    assert selectivity(np.full((10, 2, 2, 3), 0.1)) == pytest.approx(0, abs=1e-6)
    one_hot = np.zeros((10, 2, 2, 3))
    one_hot[3] = 1
    assert selectivity(one_hot) == pytest.approx(1, abs=1e-6)


def test_model_metadata(server):
    r = server.get("/model")
    assert r.status_code == 200, r.text
    body = r.json()
    single = body["single_label"]
    assert single["name"] == "cifar10-resnet" and single["task"] == "single_label"
    assert single["labels"][0] == "airplane" and single["input_shape"] == [3, 32, 32]
    assert single["backend"] == "onnxruntime" and single["providers"] == ["CPUExecutionProvider"]
    assert body["multi_label"]["name"] == "multimnist-matrix-small" and body["multi_label"]["image_size"] == 36
    assert body["versions"]["capserve"] == capserve.__version__
    # ONNX Runtime on a CPU: two batches at once, each on a separate session with half the cores
    assert body["batching"] == {"enabled": True, "max_batch_size": 16, "max_latency_ms": 30000, "batches_in_flight": 2}


def test_concurrent_requests_equal_unbatched(server, models):
    """64 concurrent uploads, batched, answer as each alone would: those up to 64×64 pixels are decoded on the event
    loop, the larger ones (100×75, 7,500 pixels) in a worker thread."""
    datas = [random_png(100 + i, (100, 75) if i % 4 == 0 else (32, 32)) for i in range(64)]
    runtime = load_runtime(models["cifar10"] / "model.onnx")  # batch of 1 each: the unbatched answers
    expected = [softmax(runtime.predict(preprocess(d, runtime.metadata))[0]) for d in datas]

    async def send_all() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=str(server.base_url), timeout=120) as client:
            return await asyncio.gather(*(client.post("/classify", **upload(d), data={"top_k": "10"}) for d in datas))

    before = batches(server)
    responses = asyncio.run(send_all())
    assert [r.status_code for r in responses] == [200] * 64
    for r, e in zip(responses, expected, strict=True):
        got = np.zeros(10)
        for p in r.json()["predictions"]:
            got[p["index"]] = p["probability"]
        np.testing.assert_allclose(got, e, atol=1e-5)
    count, total = (a - b for a, b in zip(batches(server), before, strict=True))
    assert total == 64 and count < 64, "adaptive batching should have merged some of 64 concurrent requests"


def test_uploads_are_parsed_once_and_never_written_to_disk(server):
    """RequestGuard parses each body once and hands BentoML the images' bytes: BentoML neither parses the form again
    nor writes each upload to a temporary file (in a per-request folder) for the ``Path`` parameters."""
    files = [("images", ("a.png", GOOD, "image/png"))] * 2
    for path, request in [
        ("/classify", upload(GOOD)),
        ("/classify?top_k=2", RAW_PNG),
        ("/explain", upload(GOOD)),
        ("/multilabel", upload(GOOD)),
        ("/classify_batch", dict(files=files)),
    ]:
        r = server.post(path, **request)
        assert r.status_code == 200, (path, r.text)
    assert (server.tmp / "tmp").is_dir()
    assert not list((server.tmp / "tmp").glob("bentoml-request-*"))


def test_an_upload_token_names_only_the_images_of_its_own_request():
    """The JSON that RequestGuard hands BentoML names each image by a token; a token this request's guard did not
    mint is refused (the image routes answer JSON bodies from clients with 415 before that)."""
    import contextvars

    from capserve.serving.guard import UPLOAD_TOKEN, _uploads, guarded_upload

    def bentoml_validation(value):
        return ("bentoml", value)

    token = UPLOAD_TOKEN + "0"
    with pytest.raises(ValueError, match="multipart file upload"):
        guarded_upload(token, bentoml_validation)  # no request parsed anything in this context

    def in_a_request() -> tuple:
        _uploads.set({token: b"the image"})
        with pytest.raises(ValueError):
            guarded_upload(UPLOAD_TOKEN + "1", bentoml_validation)
        return guarded_upload(token, bentoml_validation), guarded_upload("other", bentoml_validation)

    assert contextvars.copy_context().run(in_a_request) == (b"the image", ("bentoml", "other"))
    assert _uploads.get() is None


def test_requests_skip_opentelemetry_only_without_a_tracing_exporter():
    """BentoML's OpenTelemetry middleware costs ~40 % of the event loop per image request even when traces go
    nowhere: every URL is excluded when no exporter and no excluded_urls are configured, none otherwise."""
    from bentoml._internal.configuration.containers import BentoMLContainer
    from opentelemetry.util.http import ExcludeList

    from capserve.serving.process import untraced_without_exporter

    tracing, excluded = BentoMLContainer.config.tracing, BentoMLContainer.tracing_excluded_urls
    saved = tracing.exporter_type.get(), tracing.excluded_urls.get()
    url = "http://127.0.0.1:3000/classify?top_k=1"
    try:
        with excluded.patch(ExcludeList([])):
            tracing.exporter_type.set("otlp")
            assert not untraced_without_exporter() and not excluded.get().url_disabled(url)
            tracing.exporter_type.set(None)
            tracing.excluded_urls.set("/metrics")
            assert not untraced_without_exporter() and not excluded.get().url_disabled(url)
            tracing.excluded_urls.set(None)
            assert untraced_without_exporter() and excluded.get().url_disabled(url)
    finally:
        tracing.exporter_type.set(saved[0])
        tracing.excluded_urls.set(saved[1])


def test_the_heap_frozen_at_start_up_still_collects_what_requests_leave():
    """The service exempts what start-up allocated from the cyclic garbage collector (``gc.freeze``); garbage made
    afterwards, by requests, must still be collected (a server that stopped collecting would grow without bound)."""
    import gc
    import weakref

    from capserve.serving.process import freeze_startup_heap

    class Node:
        pass

    try:
        freeze_startup_heap()
        assert gc.isenabled() and gc.get_freeze_count() > 0
        node = Node()
        node.self = node  # a reference cycle: only the cyclic collector frees it
        alive = weakref.ref(node)
        del node
        gc.collect()
        assert alive() is None
    finally:
        gc.unfreeze()


def test_bad_images_among_concurrent_requests_fail_alone(server, models):
    """Under load, with adaptive batching on: a bad image fails its own request with its README status, and the
    good ones sent with it, batched, still equal unbatched answers."""
    runtime = load_runtime(models["cifar10"] / "model.onnx")
    bad = {
        "not-an-image": (b"hello, world" * 10, 400),
        "1x1": (encode(np.zeros((1, 1, 3), np.uint8)), 422),
        "over-pixel-limit": (png_header_only(1200, 1000), 413),
    }
    requests = [(random_png(200 + i), 200) for i in range(24)]
    for i, (data, status) in enumerate(bad.values()):
        requests[4 + 7 * i : 4 + 7 * i] = [(data, status)]

    async def send_all() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=str(server.base_url), timeout=120) as client:
            return await asyncio.gather(
                *(client.post("/classify", **upload(d), data={"top_k": "10"}) for d, _ in requests)
            )

    before = batches(server)
    responses = asyncio.run(send_all())
    assert [r.status_code for r in responses] == [status for _, status in requests], [r.text for r in responses]
    for r, (data, status) in zip(responses, requests, strict=True):
        if status == 413:  # against the server's limit, not the smaller one for decoding on the event loop
            assert f"the limit is {MAX_PIXELS:,} pixels" in error_of(r)
        if status != 200:
            assert error_of(r)
            continue
        got = np.zeros(10)
        for p in r.json()["predictions"]:
            got[p["index"]] = p["probability"]
        np.testing.assert_allclose(got, softmax(runtime.predict(preprocess(data, runtime.metadata))[0]), atol=1e-5)
    count, total = (a - b for a, b in zip(batches(server), before, strict=True))
    assert total >= 24 and count < total, "some of the good images should have been batched"  # bad ones: before


def batches(server) -> tuple[float, float]:
    """(batches run, images in them) for /classify's adaptive batching, from /metrics."""
    count = total = 0.0
    for line in server.get("/metrics").text.splitlines():
        if line.startswith('capserve_batch_size_count{endpoint="classify"}'):
            count = float(line.rsplit(" ", 1)[1])
        elif line.startswith('capserve_batch_size_sum{endpoint="classify"}'):
            total = float(line.rsplit(" ", 1)[1])
    return count, total


# ------------------------------------------------------------------------------------------ bad input


def animated_gif() -> bytes:
    frames = [Image.new("RGB", (32, 32), c) for c in ((200, 30, 30), (0, 0, 255))]
    buffer = io.BytesIO()
    frames[0].save(buffer, "GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)
    return buffer.getvalue()


def chunks(data: bytes):
    for i in range(0, len(data), 65536):
        yield data[i : i + 65536]


GOOD = random_png(7)


BIG = np.random.default_rng(8).integers(0, 256, (300, 400, 3), dtype=np.uint8)


JPEG = encode(np.full((32, 32, 3), 120, np.uint8), "JPEG")


MULTIPART = "multipart/form-data; boundary=xyz"


RAW_PNG = {"content": GOOD, "headers": {"content-type": "image/png"}}


# The README's error table, row by row: each row's first words (as in README "Errors") → its requests
EMPTY, NOT_IMAGE, FORM, PARAMETER, PIXELS = (
    "an empty body or file",
    "bytes that are not an image",
    "a malformed multipart body",
    "a parameter out of",
    "`/logits`: pixels",
)


BYTES, PIXEL_LIMIT, IMAGE_COUNT, MEDIA, SMALL = (
    "a body over",
    "an image over",
    "more than `CAPSERVE_MAX_IMAGES`",
    "a content type other",
    "an image under 8",
)


METHOD = "a method the route"


BAD_INPUTS = {
    "empty-raw-body": (EMPTY, "/classify", dict(content=b"", headers={"content-type": "image/png"})),
    "empty-no-content-type": (EMPTY, "/classify", dict(content=b"")),
    "empty-multipart": (FORM, "/classify", dict(content=b"--xyz--\r\n", headers={"content-type": MULTIPART})),
    "empty-file": (EMPTY, "/classify", upload(b"")),
    "not-an-image": (NOT_IMAGE, "/classify", upload(b"hello, world" * 10)),
    "not-an-image-raw": (NOT_IMAGE, "/classify", dict(content=b"%PDF-1.4", headers={"content-type": "image/jpeg"})),
    "truncated-png": (NOT_IMAGE, "/classify", upload(random_png(9, (64, 64))[:700])),
    "truncated-jpeg": (NOT_IMAGE, "/classify", upload(encode(BIG, "JPEG")[:2000], content_type="image/jpeg")),
    "batch-with-bad-image": (
        NOT_IMAGE,
        "/classify_batch",
        dict(files=[("images", ("a.png", GOOD, "image/png")), ("images", ("b.png", b"junk", "image/png"))]),
    ),
    "over-byte-limit": (BYTES, "/classify", upload(encode(BIG, "BMP"))),
    "over-byte-limit-chunked": (
        BYTES,
        "/classify",
        dict(content=chunks(encode(BIG, "BMP")), headers={"content-type": "image/bmp"}),
    ),
    "decompression-bomb": (PIXEL_LIMIT, "/classify", upload(png_header_only(100_000, 100_000))),
    "over-pixel-limit": (PIXEL_LIMIT, "/classify", upload(png_header_only(1200, 1000))),
    "zero-sized": (NOT_IMAGE, "/classify", upload(png_header_only(0, 0))),
    "1x1": (SMALL, "/classify", upload(encode(np.zeros((1, 1, 3), np.uint8)))),
    "wrong-field-name": (FORM, "/classify", upload(GOOD, field="file")),
    "field-as-text": (FORM, "/classify", dict(data={"image": "http://127.0.0.1:1/x.png"}, files={"x": ("x", b"1")})),
    "field-not-image-type": (MEDIA, "/classify", upload(GOOD, content_type="text/plain")),
    "field-pdf-type": (MEDIA, "/classify", upload(GOOD, content_type="application/pdf")),  # an image declared as a PDF
    "top-k-zero": (PARAMETER, "/classify", dict(**upload(GOOD), data={"top_k": "0"})),
    "top-k-above-labels": (PARAMETER, "/classify", dict(**upload(GOOD), data={"top_k": "11"})),
    "top-k-above-labels-batch": (
        PARAMETER,
        "/classify_batch",
        dict(files=[("images", ("a.png", GOOD))], data={"top_k": "11"}),
    ),
    "top-k-text": (PARAMETER, "/classify", dict(**upload(GOOD), data={"top_k": "many"})),
    "top-k-query": (PARAMETER, "/classify?top_k=-1", RAW_PNG),
    "capsules-zero": (PARAMETER, "/explain?capsules=0", RAW_PNG),
    "threshold-zero": (PARAMETER, "/multilabel", dict(**upload(GOOD), data={"threshold": "0"})),
    "threshold-one": (PARAMETER, "/multilabel", dict(**upload(GOOD), data={"threshold": "1"})),
    "threshold-big": (PARAMETER, "/multilabel?threshold=1.5", RAW_PNG),
    "threshold-nan": (PARAMETER, "/multilabel?threshold=nan", RAW_PNG),
    "bad-query-name": (PARAMETER, "/classify?a%0d%0ab=1", RAW_PNG),
    "bad-query-name-multipart": (PARAMETER, "/classify?a%0d%0ab=1", upload(GOOD)),
    "top-k-query-multipart": (PARAMETER, "/classify?top_k=0", upload(GOOD)),
    "top-k-form-and-query-differ": (PARAMETER, "/classify?top_k=2", dict(**upload(GOOD), data={"top_k": "3"})),
    "unknown-query-name": (PARAMETER, "/classify?topk=3", RAW_PNG),
    "unknown-query-name-multipart": (PARAMETER, "/multilabel?top_k=3", upload(GOOD)),
    "unknown-form-field": (PARAMETER, "/explain", dict(**upload(GOOD), data={"capsule": "3"})),
    "json-content-type": (MEDIA, "/classify", dict(json={"image": "x"})),
    "text-content-type": (MEDIA, "/explain", dict(content=b"abc", headers={"content-type": "text/plain"})),
    "malformed-multipart": (
        FORM,
        "/classify",
        dict(content=b'--xyz\r\nContent-Disposition: form-data; name="image"', headers={"content-type": MULTIPART}),
    ),
    "multipart-no-boundary": (FORM, "/classify", dict(content=b"abc", headers={"content-type": "multipart/form-data"})),
    "too-many-images": (
        IMAGE_COUNT,
        "/classify_batch",
        dict(files=[("images", ("a.png", GOOD, "image/png"))] * (MAX_IMAGES + 1)),
    ),
    "logits-float": (PIXELS, "/logits", dict(json={"images": [[[[0.5] * 32] * 32] * 3]})),
    "logits-shape": (PIXELS, "/logits", dict(json={"images": [[[[1] * 8] * 8] * 3]})),
    "logits-range": (PIXELS, "/logits", dict(json={"images": [[[[300] * 32] * 32] * 3]})),
    # the fuzzer's finds: a 0-d array reached BentoML's batcher (500), a boundary-less multipart body starlette (500)
    "logits-object": (PIXELS, "/logits", dict(json={"images": {}})),
    "multilabel-logits-empty": (PIXELS, "/multilabel_logits", dict(json={"images": []})),
    "logits-scalars": (PIXELS, "/logits", dict(json={"images": [0]})),
    "logits-not-json": (PIXELS, "/logits", dict(content=b"{images", headers={"content-type": "application/json"})),
    "model-multipart-no-boundary": (MEDIA, "/model", dict(content=b"{}", headers={"content-type": MULTIPART[:19]})),
    "logits-form": (MEDIA, "/logits", dict(data={"images": "[[[[0]]]]"})),
    "post-on-readyz": (METHOD, "/readyz", dict(content=b"{}")),
}


def readme_errors() -> dict[str, int]:
    """The README's error table: each row's text → its status."""
    text = (ROOT / "README.md").read_text()
    table = text[text.index("| status | error |") :].split("\n\n")[0].splitlines()[2:]
    rows = {}
    for line in table:
        status, reason = (cell.strip() for cell in line.strip("|").split("|")[:2])
        rows[reason] = int(status)
    return rows


def readme_row(prefix: str) -> tuple[str, int]:
    (row,) = [(reason, status) for reason, status in readme_errors().items() if reason.startswith(prefix)]
    return row


def test_every_readme_error_row_is_tested():
    tested = {readme_row(prefix)[0] for prefix, *_ in BAD_INPUTS.values()} | {
        readme_row(p)[0] for p in (*SERVER_ROWS, *KEY_ROWS)
    }
    assert tested == set(readme_errors()), set(readme_errors()) - tested


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_gets_the_readme_status_and_one_json_error(server, name):
    row, path, request = BAD_INPUTS[name]
    reason, status = readme_row(row)
    r = server.post(path, **request)
    assert r.status_code == status, (reason, r.status_code, r.text)
    assert error_of(r)
    good = server.post("/classify", **upload(GOOD))
    assert good.status_code == 200, good.text


def test_a_bad_request_logs_one_line(server, server_log):
    server.post("/classify", **upload(GOOD), data={"top_k": "0"})
    server.post("/classify", **upload(b"junk"))
    time.sleep(0.5)
    log = server_log.read_text()
    assert "POST /classify 400 top_k: Input should be greater than or equal to 1" in log
    assert "POST /classify 400 the image:" in log
    assert "Traceback" not in log and "Exception on /classify" not in log


@pytest.mark.parametrize(
    "data, content_type",
    [(animated_gif(), "image/gif"), (JPEG, "image/png"), (JPEG, "application/octet-stream")],
    ids=["animated-gif-first-frame", "jpeg-labelled-png", "octet-stream"],
)
def test_odd_but_valid_input_is_served(server, eager, data, content_type):
    r = server.post("/classify?top_k=10", content=data, headers={"content-type": content_type})
    assert r.status_code == 200, r.text
    best = r.json()["predictions"][0]
    assert best["index"] == int(np.argmax(eager_logits(eager["cifar10"], data)))


def untyped_part(data: bytes) -> dict:
    """A multipart body whose file part has no Content-Type, as Python's ``requests`` sends a plain file tuple."""
    body = (
        b'--xyz\r\nContent-Disposition: form-data; name="image"; filename="photo"\r\n\r\n' + data + b"\r\n--xyz--\r\n"
    )
    return dict(content=body, headers={"content-type": MULTIPART})


@pytest.mark.parametrize(
    "request_",
    [upload(JPEG, content_type="application/octet-stream"), untyped_part(JPEG)],
    ids=["curl-without-extension", "requests-file-tuple"],
)
def test_an_image_part_without_an_image_type_is_served(server, eager, request_):
    """The bytes decide: a file part sent as application/octet-stream (curl, a name without a known extension) or
    without a Content-Type (Python's requests) is the image it holds."""
    r = server.post("/classify?top_k=10", **request_)
    assert r.status_code == 200, r.text
    assert r.json()["predictions"][0]["index"] == int(np.argmax(eager_logits(eager["cifar10"], JPEG)))


SERVER_ROWS = ("an endpoint whose model", "a request queued")  # README rows the second server below tests


KEY_ROWS = ("no `Authorization",)  # README rows tests/serving/test_contract.py tests (its server has API keys)


def test_an_open_server_says_so_once_at_start_up(server_log):
    assert server_log.read_text().count("CAPSERVE_API_KEYS is not set: this server is open") == 1


def test_a_second_server_keeps_the_first_ones_metrics_and_answers_501_and_503(server, models):
    """Started beside the first with the same BENTOML_HOME (BentoML's shared Prometheus folder is wiped by each
    start), with no multi-label model, no explanation graph (501s), a 1 ms batching budget (503s under a burst,
    logged as warnings, never for a lone request, which runs without queueing) and BentoML's access log on (off on
    the first server)."""
    for _ in range(3):
        server.post("/classify", **upload(GOOD))
    before = requests_total(server, "/classify")
    bare = server.tmp / "bare"
    bare.mkdir(exist_ok=True)
    for name in ("config.json", "model.safetensors", "model.onnx"):
        (bare / name).write_bytes((models["cifar10"] / name).read_bytes())
    proc, url, log = start_server(
        server.tmp,
        CAPSERVE_MODEL=str(bare),
        CAPSERVE_MULTILABEL_MODEL="none",
        CAPSERVE_MAX_LATENCY_MS="1",
        CAPSERVE_MAX_BATCH_SIZE="4",
        CAPSERVE_ACCESS_LOG="1",
    )
    try:
        wait_ready(proc, url, log)
        assert requests_total(server, "/classify") >= before >= 3
        with httpx.Client(base_url=url, timeout=60) as second:
            for path in ("/multilabel", "/explain"):
                r = second.post(path, **upload(GOOD))
                assert r.status_code == readme_row(SERVER_ROWS[0])[1] == 501, r.text
                assert "CAPSERVE_MULTILABEL_MODEL" in error_of(r) or "--explain" in error_of(r)
            lone = [second.post("/classify", **upload(GOOD)).status_code for _ in range(10)]
            assert lone == [200] * 10, "a request with nothing else in progress must not wait for (or in) a batch"

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                return await asyncio.gather(*(client.post("/classify", **upload(GOOD)) for _ in range(48)))

        responses = asyncio.run(burst())
        assert {r.status_code for r in responses} <= {200, 503}
        overloaded = [r for r in responses if r.status_code == readme_row(SERVER_ROWS[1])[1] == 503]
        assert overloaded, "48 concurrent requests with a 1 ms batching budget should overload it"
        assert all(error_of(r) for r in overloaded)
    finally:
        stop(proc)
    assert "path=/classify" in log.read_text(), "CAPSERVE_ACCESS_LOG=1: BentoML's access log line per request"
    shed = [line for line in log.read_text().splitlines() if "adaptive batching has shed" in line]
    assert len(shed) == 1 and "/classify" in shed[0] and "ms per image" in shed[0], shed  # one line, not one each
    # each shed request: one WARNING line with its reason (an expected state, not a fault), no traceback
    answered = [line for line in log.read_text().splitlines() if "POST /classify 503" in line]
    assert len(answered) == len(overloaded), answered
    assert all("[WARNING]" in line and "CAPSERVE_MAX_LATENCY_MS" in line for line in answered), answered
    assert "Exception on /classify" not in log.read_text() and "Traceback" not in log.read_text()
    assert "path=/classify" not in server.log_path.read_text(), "the access log is off by default"


def test_metrics_readyz_livez(server):
    assert server.get("/readyz").status_code == 200
    assert server.get("/livez").status_code == 200
    server.post("/classify", **upload(GOOD))
    metrics = server.get("/metrics")
    assert metrics.status_code == 200
    assert 'bentoml_service_request_total{endpoint="/classify"' in metrics.text.replace(", ", ",")
    assert 'capserve_batch_size_count{endpoint="classify"}' in metrics.text


def test_corrupt_model_fails_startup(models, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", "model.safetensors"):
        (broken / name).write_bytes((models["cifar10"] / name).read_bytes())
    (broken / "model.onnx").write_bytes((models["cifar10"] / "model.onnx").read_bytes()[:5000])
    assert "is not a loadable ONNX model" in failed_start(tmp_path, CAPSERVE_MODEL=str(broken))


def test_a_model_that_does_not_exist_stops_the_server_in_one_line(tmp_path):
    """It said so in one CRITICAL line, buried in 66 lines with two full tracebacks of the same message."""
    log = failed_start(tmp_path, CAPSERVE_MODEL="runs/nosuch")
    assert "Traceback" not in log and log.count("runs/nosuch") == 1, log
    assert "is neither a directory" in next(line for line in log.splitlines() if "capserve cannot start" in line)


def test_missing_artifact_fails_startup(models, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_bytes((models["cifar10"] / "config.json").read_bytes())
    log = failed_start(tmp_path, CAPSERVE_MODEL=str(bare))
    assert "has no model.onnx" in log and "capserve export onnx" in log


def test_bad_setting_fails_startup_without_a_traceback(models, tmp_path):
    """Settings are read when BentoML imports the service: a bad one is one line and exit status 3, not BentoML's
    traceback and status 1."""
    log = failed_start(tmp_path, CAPSERVE_MODEL=str(models["cifar10"]), CAPSERVE_MAX_BATCH_SIZE="lots")
    assert "CAPSERVE_MAX_BATCH_SIZE" in log and "Traceback" not in log


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a CPU-only torch asked for CUDA")
def test_torch_backend_on_cuda_without_cuda_fails_startup_clearly(models, tmp_path):
    """The GPU bento's preset CAPSERVE_DEVICE=cuda with the torch backend and a CPU torch: an uncaught
    AssertionError made BentoML respawn the worker forever."""
    log = failed_start(
        tmp_path, CAPSERVE_MODEL=str(models["cifar10"]), CAPSERVE_BACKEND="torch", CAPSERVE_DEVICE="cuda"
    )
    assert "this torch" in log and "use the onnxruntime backend" in log


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the worker's memory map in /proc")
def test_the_server_parses_http_with_httptools_on_uvloop(server):
    """uvicorn, under BentoML, takes httptools and uvloop where they are installed (capserve[serve] brings them):
    less CPU per request on the event loop than h11 and asyncio (docs/benchmarks/serving.md)."""
    import psutil

    workers = psutil.Process(server.pid).children(recursive=True)
    assert workers
    for worker in workers:
        loaded = Path(f"/proc/{worker.pid}/maps").read_text()
        assert "httptools" in loaded and "uvloop" in loaded, worker.cmdline()


# ------------------------------------------------------------------------------------------ settings, build


def test_settings_from_env():
    s = Settings.from_env({"CAPSERVE_MAX_BATCH_SIZE": "4", "CAPSERVE_BACKEND": "torch", "CAPSERVE_ITERATIONS": "3"})
    assert (s.max_batch_size, s.backend, s.iterations, s.model) == (4, "torch", 3, "models/cifar10")
    assert not s.access_log and Settings.from_env({"CAPSERVE_ACCESS_LOG": " TRUE "}).access_log
    for env, message in [
        ({"CAPSERVE_BACKEND": "tf"}, "choose one of"),
        ({"CAPSERVE_MAX_BYTES": "lots"}, "not an integer"),
        ({"CAPSERVE_MAX_BATCH_SIZE": "0"}, ">= 1"),
        ({"CAPSERVE_ITERATIONS": "3"}, "torch backend only"),
        ({"CAPSERVE_ACCESS_LOG": "yes"}, "use 1 or 0"),
    ]:
        with pytest.raises(ConfigurationError, match=message):
            Settings.from_env(env)


# ------------------------------------------------------------------------------------------ model store, bentos


@pytest.fixture(scope="module")
def store(models, tmp_path_factory) -> Path:
    """A temporary BENTOML_HOME (its parent, as start_server takes it) whose model store holds the tiny models
    under the names the bentofiles declare, saved by `capserve export bentoml` (the explanation graph made on the
    way for multimnist, which lacks one)."""
    tmp = tmp_path_factory.mktemp("store")
    env = {**os.environ, "BENTOML_HOME": str(tmp / "bentoml"), "BENTOML_DO_NOT_TRACK": "True"}
    script = (
        "import sys; from capserve.cli import main\n"
        "for model, name in zip(sys.argv[1::2], sys.argv[2::2]):\n"
        "    assert main(['export', 'bentoml', model, '--name', name]) == 0"
    )
    args = [str(models["cifar10"]), "capserve-cifar10", str(models["multimnist"]), "capserve-multimnist"]
    r = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("capserve-") == 2, r.stdout
    return tmp


def stored(store: Path, name: str) -> Path:
    (folder,) = (store / "bentoml" / "models" / name).glob("*/")
    return folder


def test_export_bentoml_saves_the_whole_model_folder(store, models):
    import yaml

    folder = stored(store, "capserve-multimnist")
    info = yaml.safe_load((folder / "model.yaml").read_text())
    assert info["labels"] == {"task": "multi_label", "dataset": "multimnist", "config": "multimnist-matrix-small"}
    assert info["metadata"]["iterations"] == 2 and info["metadata"]["classes"] == 10
    assert info["metadata"]["weights_sha256"] == file_sha256(models["multimnist"] / "model.safetensors")
    assert {"config.json", "model.safetensors", "model.onnx", "model-explain.onnx"} <= {
        p.name for p in folder.iterdir()
    }
    assert not (models["multimnist"] / "model-explain.onnx").exists()  # made in the store, not in the source
    assert load_runtime(folder / "model-explain.onnx").explainable


def test_export_bentoml_refuses_stale_graphs_and_non_models(models, tmp_path, capsys):
    from capserve.cli import main

    stale = tmp_path / "stale"
    stale.mkdir()
    for name in ("config.json", "model.safetensors"):
        (stale / name).write_bytes((models["multimnist"] / name).read_bytes())
    (stale / "model.onnx").write_bytes((models["cifar10"] / "model.onnx").read_bytes())  # another model's graph
    assert main(["export", "bentoml", str(stale), "--name", "x"]) == 2
    assert "was exported from other weights" in capsys.readouterr().err
    assert main(["export", "bentoml", str(tmp_path), "--name", "x"]) == 2
    assert "is not a model directory" in capsys.readouterr().err
    (stale / "model.onnx").unlink()  # its own graphs, and an INT8-named one from another model
    (stale / "model-int8.onnx").write_bytes((models["cifar10"] / "model.onnx").read_bytes())
    assert main(["export", "bentoml", str(stale), "--name", "x"]) == 2
    err = capsys.readouterr().err
    assert "model-int8.onnx was exported from other weights" in err and "--int8 --calibration DATA`" in err


def test_export_bentoml_carries_the_folders_other_graphs(models, tmp_path):
    """Every graph in the folder travels into the store (an INT8 graph a tuned file or the start-up measurement
    may choose): a server of NAME finds it there."""
    folder = tmp_path / "model"
    shutil.copytree(models["cifar10"], folder)
    shutil.copy(folder / "model.onnx", folder / "model-int8.onnx")  # same weights: what matters here is the copy
    env = {**os.environ, "BENTOML_HOME": str(tmp_path / "bentoml"), "BENTOML_DO_NOT_TRACK": "True"}
    script = (
        "import sys; from capserve.cli import main; sys.exit(main(['export', 'bentoml', sys.argv[1], '--name', 'm']))"
    )
    r = subprocess.run(
        [sys.executable, "-c", script, str(folder)], env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (stored_folder,) = (tmp_path / "bentoml" / "models" / "m").glob("*/")
    assert (stored_folder / "model-int8.onnx").read_bytes() == (folder / "model-int8.onnx").read_bytes()


def test_serving_from_the_model_store(store, eager):
    """CAPSERVE_MODEL=NAME[:VERSION] from BentoML's model store, with the real `bentoml serve`."""
    version = stored(store, "capserve-cifar10").name
    proc, url, log = start_server(
        store, CAPSERVE_MODEL=f"capserve-cifar10:{version}", CAPSERVE_MULTILABEL_MODEL="capserve-multimnist"
    )
    try:
        wait_ready(proc, url, log)
        with httpx.Client(base_url=url, timeout=60) as client:
            body = client.get("/model").json()
            assert body["single_label"]["tag"] == f"capserve-cifar10:{version}"
            assert body["multi_label"]["tag"].startswith("capserve-multimnist:")
            r = client.post("/classify?top_k=10", content=GOOD, headers={"content-type": "image/png"})
            got = {p["index"]: p["probability"] for p in r.json()["predictions"]}
            np.testing.assert_allclose(
                [got[i] for i in range(10)], softmax(eager_logits(eager["cifar10"], GOOD)), atol=1e-5
            )
            assert client.post("/explain", content=GOOD, headers={"content-type": "image/png"}).status_code == 200
    finally:
        stop(proc)
    log_text = failed_start(store, CAPSERVE_MODEL="capserve-nothing")
    assert "nor a model in BentoML's model store" in log_text and "capserve export bentoml" in log_text


@pytest.mark.slow
@pytest.mark.parametrize(
    "bentofile, name, device", [("bentofile.yaml", "capserve", "gpu"), ("bentofile-cpu.yaml", "capserve-cpu", "cpu")]
)
def test_bentoml_build(store, bentofile, name, device):
    import yaml

    env = {**os.environ, "BENTOML_HOME": str(store / "bentoml"), "BENTOML_DO_NOT_TRACK": "True"}
    r = subprocess.run(
        [BENTOML, "build", "-f", bentofile, "--output", "tag"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (bento,) = (store / "bentoml" / "bentos" / name).glob("*/bento.yaml")
    info = yaml.safe_load(bento.read_text())
    packed = {m["tag"] for m in info["models"]}
    assert packed == {f"{n}:{stored(store, n).name}" for n in ("capserve-cifar10", "capserve-multimnist")}
    envs = {e["name"]: e["value"] for e in info["envs"]}
    assert envs["CAPSERVE_MODEL"] == "capserve-cifar10" and envs["CAPSERVE_DEVICE"] == (
        "cuda" if device == "gpu" else "cpu"
    )
    requirements = (bento.parent / "env" / "python" / "requirements.txt").read_text()
    dockerfile = (bento.parent / "env" / "docker" / "Dockerfile").read_text()
    if device == "gpu":
        assert "onnxruntime-gpu>=1.21,<1.27" in requirements and "nvidia/cuda:12.8" in dockerfile
    else:
        assert "onnxruntime-gpu" not in requirements and "onnxruntime" in requirements and "nvidia" not in dockerfile
    src = bento.parent / "src"
    assert (src / "service.py").is_file() and (src / "capserve" / "serving" / "service.py").is_file()
    assert (src / "capserve" / "export" / "onnx.py").is_file()  # the exporter ships inside the package
    assert (src / "capserve" / "serving" / "ui" / "index.html").is_file()  # the web page, with its examples
    assert len(list((src / "capserve" / "serving" / "ui" / "examples").glob("*.png"))) >= 4
    assert not (bento.parent / "src" / "models").exists()  # models come from the store, not the source tree
    if device == "cpu":
        serve_the_built_bento(store, f"{name}:{bento.parent.name}")


def serve_the_built_bento(store: Path, tag: str) -> None:
    """``bentoml serve NAME:VERSION`` with no CAPSERVE_* set serves the models packed in it, with the bento's own
    settings, which BentoML applies only inside a container (else the service looks for models/cifar10 and exits
    with status 3)."""
    from support.server import free_port, grace_period, stop_under_load

    env = {k: v for k, v in os.environ.items() if not k.startswith("CAPSERVE_")}
    env.update(BENTOML_HOME=str(store / "bentoml"), BENTOML_DO_NOT_TRACK="True")
    port = free_port()
    log = store / f"bento-{port}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [BENTOML, "serve", tag, "--host", "127.0.0.1", "--port", str(port)],
            cwd=store,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url, log)
        body = httpx.get(f"{url}/model", timeout=60).json()
        assert body["single_label"]["tag"].startswith("capserve-cifar10:"), body
        assert body["multi_label"]["tag"].startswith("capserve-multimnist:"), body
        r = httpx.post(f"{url}/classify", content=GOOD, headers={"content-type": "image/png"}, timeout=60)
        assert r.status_code == 200, r.text
        assert body["ui"] is True and "<title>capserve</title>" in httpx.get(f"{url}/ui/", timeout=30).text
        explained = httpx.post(f"{url}/explain", content=GOOD, headers={"content-type": "image/png"}, timeout=60)
        assert explained.status_code == 200 and explained.json()["occlusion"]["forward_passes"] == 17, explained.text
        grace = grace_period(ROOT / "deploy" / "kubernetes" / "deployment-cpu.yaml")
        drain = stop_under_load(proc, url, grace)  # a built bento stops as a pod expects, too
    finally:
        stop(proc)
    assert set(drain.answers) == {200} and drain.last_answer > drain.stopped, drain
    assert drain.code == 0 and drain.took < grace, drain


def test_api_keys_setting(tmp_path):
    assert Settings.from_env({}).api_keys == ()
    keys = Settings.from_env({"CAPSERVE_API_KEYS": " key-one-123, key-two-456 ,key-one-123"})
    assert keys.api_keys == ("key-one-123", "key-two-456")
    assert "key-one" not in repr(keys)  # settings may be logged; keys never are
    (tmp_path / "keys").write_text("# capserve keys\n\nkey-from-file-1\n  key-from-file-2  \n")
    assert Settings.from_env({"CAPSERVE_API_KEYS": f"@{tmp_path / 'keys'}"}).api_keys == (
        "key-from-file-1",
        "key-from-file-2",
    )
    (tmp_path / "empty").write_text("# nothing yet\n")
    for value, message in [
        (f"@{tmp_path / 'missing'}", "cannot read the key file"),
        (f"@{tmp_path / 'empty'}", "holds no key"),
        (" , ", "holds no key"),
        ("short", "at least 8"),
        ("has a space inside", "at least 8 visible ASCII"),
        ("ключ-ключ-ключ", "visible ASCII"),
    ]:
        with pytest.raises(ConfigurationError, match=message) as error:
            Settings.from_env({"CAPSERVE_API_KEYS": value})
        assert "ключ" not in str(error.value) and "inside" not in str(error.value)  # messages never quote a key
