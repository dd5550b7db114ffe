"""``Answerer``, the one images -> answers composition of the service and ``capserve predict``: the same bytes give
the same answers through the service's routes (in-process and over HTTP) and ``Predictor``; each kind of refusal
has its status in the server's one table and its place in predict's report; bad images are refused by kind, in
their places, or the whole request for ``/classify_batch``."""

from __future__ import annotations

import ast
import asyncio
import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from support.images import png_header_only
from support.inprocess import in_process_service
from support.server import random_png, upload

from capserve.pipeline.answerer import Answerer
from capserve.pipeline.errors import ErrorKind, RequestError
from capserve.pipeline.models import OpenOptions, open_model
from capserve.pipeline.schemas import Classification, MultiLabel
from capserve.predict import Predictor
from capserve.predict.predictor import RECORDED, record

ROOT = Path(__file__).resolve().parents[2]
CIFAR10, MULTIMNIST = str(ROOT / "models" / "cifar10"), str(ROOT / "models" / "multimnist")


def float_tiff_with_nan() -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.full((32, 32), np.nan, np.float32), "F").save(buffer, "TIFF")
    return buffer.getvalue()


GOOD = [random_png(i, (40 + i, 32)) for i in range(3)]


# a bad image of each kind decoding refuses → its kind and the status the README gives it
BAD = {
    "undecodable": (b"this is not an image" * 5, ErrorKind.BAD_INPUT, 400),
    "oversized": (png_header_only(6000, 5000), ErrorKind.TOO_LARGE, 413),  # 30 M pixels > the default 25 M
    "too small": (random_png(0, (4, 4)), ErrorKind.TOO_SMALL, 422),
    "unsupported": (float_tiff_with_nan(), ErrorKind.UNSUPPORTED, 422),
}


def assert_same(a: Classification | dict, b: Classification | dict) -> None:
    """The same answer, probabilities up to float noise (a batch of other images may round them otherwise)."""
    a, b = (x.model_dump() if isinstance(x, Classification) else x for x in (a, b))
    assert [p["label"] for p in a["predictions"]] == [p["label"] for p in b["predictions"]]
    got = [p["probability"] for p in a["predictions"]]
    np.testing.assert_allclose(got, [p["probability"] for p in b["predictions"]], atol=1e-5)


@pytest.fixture(scope="module")
def answerer() -> Answerer:
    return Answerer(open_model(CIFAR10, OpenOptions(), explain=False)[0])


def test_every_kind_has_one_status_in_the_server_and_one_place_in_predicts_report():
    pytest.importorskip("bentoml")
    from capserve.serving.app import STATUSES, http_error

    assert set(STATUSES) == set(ErrorKind) == set(RECORDED)
    expected = {
        ErrorKind.BAD_INPUT: 400,
        ErrorKind.TOO_LARGE: 413,
        ErrorKind.TOO_SMALL: 422,
        ErrorKind.UNSUPPORTED: 422,
        ErrorKind.UNAVAILABLE: 501,
        ErrorKind.BUSY: 503,
    }
    assert {kind: int(status) for kind, status in STATUSES.items()} == expected
    for kind, status in expected.items():
        error = http_error(RequestError(kind, f"{kind.value}: how to fix it"))
        assert int(error.error_code) == status and str(error) == f"{kind.value}: how to fix it"
    # an image's refusal is its row in capserve predict; a refusal of the whole request stops the run
    for kind in ErrorKind:
        refusal = RequestError(kind, "the image: why")
        if kind in (ErrorKind.UNAVAILABLE, ErrorKind.BUSY):
            with pytest.raises(RequestError):
                record(refusal)
        else:
            assert record(refusal) == {"error": "the image: why"}


def test_bad_images_are_refused_by_kind_in_their_places(answerer):
    """Undecodable, oversized, too small and unsupported images, and a wrong-typed array, through the one function:
    each refused in its place with its kind, the good images answered as on their own."""
    wrong_type = np.zeros((32, 32, 3), np.float32)
    uploads = [GOOD[0], *(data for data, _, _ in BAD.values()), wrong_type, GOOD[1]]
    results = answerer.answer(uploads, top_k=3)
    assert len(results) == len(uploads)
    assert isinstance(results[0], Classification) and len(results[-1].predictions) == 3
    assert_same(results[0], answerer.answer([GOOD[0]], top_k=3)[0])
    assert_same(results[-1], answerer.answer([GOOD[1]], top_k=3)[0])
    for result, (_, kind, _) in zip(results[1:], BAD.values(), strict=False):
        assert isinstance(result, RequestError) and result.kind is kind and str(result).startswith("the image: ")
    assert results[-2].kind is ErrorKind.BAD_INPUT and "must be uint8" in str(results[-2])


def test_one_request_falls_whole_at_its_first_bad_image_named_by_position(answerer):
    with pytest.raises(RequestError, match=r"^image 1: ") as refused:
        answerer.answer([GOOD[0], BAD["oversized"][0], BAD["undecodable"][0]], all_or_none=True)
    assert refused.value.kind is ErrorKind.TOO_LARGE
    assert answerer.answer(GOOD, all_or_none=True) == answerer.answer(GOOD)


def test_options_out_of_range_refuse_before_any_image_is_decoded(answerer):
    with pytest.raises(RequestError, match="top_k=11") as refused:
        answerer.answer([b"not an image"], top_k=11)
    assert refused.value.kind is ErrorKind.BAD_INPUT
    with pytest.raises(RequestError, match=r"threshold must be in \(0, 1\)"):
        answerer.answer(GOOD, threshold=1.5)


def test_the_route_decides_the_answer_the_model_task_by_default():
    runtime = open_model(MULTIMNIST, OpenOptions(), explain=False)[0]
    assert isinstance(Answerer(runtime).answer(GOOD[:1])[0], MultiLabel)
    assert isinstance(Answerer(runtime, multi_label=False).answer(GOOD[:1])[0], Classification)  # /classify's


def test_the_service_in_process_answers_as_predictor():
    """``Capsules`` (lone requests, concurrent ones through adaptive batching, /classify_batch) and ``Predictor``
    give equal answers for the same bytes, and refuse a bad image in the same words with the same kind."""
    from capserve.serving.app import Capsules
    from capserve.serving.settings import Settings

    capsules = Capsules(Settings(model=CIFAR10, multilabel_model=MULTIMNIST), error=lambda e: e)
    predictor, multi = Predictor(CIFAR10, top_k=3), Predictor(MULTIMNIST, threshold=0.3)
    expected, expected_multi = predictor.predict(GOOD), [multi.predict([data])[0] for data in GOOD]

    async def requests() -> tuple[list, list, list, list]:
        lone = [await capsules.classify(data, 3) for data in GOOD]
        together = await asyncio.gather(*(capsules.classify(data, 3) for data in GOOD * 3))
        batch = await capsules.classify_batch(GOOD, 3)
        labels = [await capsules.multilabel(data, 0.3) for data in GOOD]
        return lone, together, batch, labels

    lone, together, batch, labels = asyncio.run(requests())
    assert [a.model_dump() for a in batch] == expected  # the same images in one batch
    for a, b in zip([*lone, *together], expected * 4, strict=True):
        assert_same(a, b)
    assert [a.model_dump() for a in labels] == expected_multi  # one image at a time on both sides
    for data, kind, _ in BAD.values():
        with pytest.raises(RequestError) as refused:
            asyncio.run(capsules.classify(data))
        assert refused.value.kind is kind and {"error": str(refused.value)} == predictor.predict([data])[0]


def test_the_same_bytes_over_http_give_predictors_rows(tmp_path):
    """Each route's JSON body, answer or error, equals ``Predictor``'s row for the same bytes; an error's status
    is its kind's."""
    pytest.importorskip("bentoml")
    predictor = Predictor(CIFAR10, top_k=2)
    with in_process_service(tmp_path, CAPSERVE_MODEL=CIFAR10, CAPSERVE_MULTILABEL_MODEL="none") as client:
        for data in GOOD:
            served = client.post("/classify", **upload(data), data={"top_k": "2"})
            assert served.status_code == 200 and served.json() == predictor.predict([data])[0]
        for data, _, status in BAD.values():
            served = client.post("/classify", **upload(data))
            assert served.status_code == status and served.json() == predictor.predict([data])[0], served.text
        files = [("images", (f"{i}.png", d, "image/png")) for i, d in enumerate(GOOD)]
        batch = client.post("/classify_batch", files=files, data={"top_k": "2"})
        assert batch.status_code == 200
        for a, b in zip(batch.json(), predictor.predict(GOOD), strict=True):
            assert_same(a, b)


def test_the_pipeline_and_predict_refuse_by_kind_never_by_status():
    """No ``RequestError`` made below the server takes a literal (a status), and no HTTP status number is written
    there: the server's ``STATUSES`` is the one place that chooses them."""
    for source in [*(ROOT / "capserve" / "pipeline").glob("*.py"), *(ROOT / "capserve" / "predict").glob("*.py")]:
        tree = ast.parse(source.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "RequestError":
                assert not isinstance(node.args[0], ast.Constant), (source, node.lineno)
            if isinstance(node, ast.Constant) and type(node.value) is int:
                assert not 400 <= node.value < 600, (source, node.lineno)
        assert "HTTPStatus" not in source.read_text(), source
