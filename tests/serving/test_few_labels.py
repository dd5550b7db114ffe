"""A model with fewer labels than the default ``top_k`` (5), such as the docs' three-shape demo: every door a user
asks it through answers the default question, "up to 5 labels" — ``POST /classify`` and ``/classify_batch`` without
``top_k``, the web page's own requests (headless Chromium when it is installed; the page's requests over HTTP
always) — while a ``top_k`` above the labels, named explicitly, is still a 400 in the same words.
``capserve predict`` has the same tests in ``predict/test_predict.py``."""

from __future__ import annotations

import re

import pytest
from support.browser import chromium
from support.inprocess import in_process_service
from support.models import tiny_model
from support.server import export, random_png, start_server, stop, upload, wait_ready

from capserve.serving.ui import page_html

SHAPES = ("circle", "square", "triangle")


@pytest.fixture(scope="module", params=[2, 3], ids=["2-labels", "3-labels"])
def few(request, tmp_path_factory) -> dict:
    """A single-label model (with its explanation graph) and a multi-label one, both with 2 or 3 labels."""
    labels = SHAPES[: request.param]
    tmp = tmp_path_factory.mktemp(f"labels{request.param}")
    return {
        "labels": labels,
        "tmp": tmp,
        "single": export(tiny_model("cifar10-simple", labels=labels), tmp / "single", explain=True),
        "multi": export(tiny_model("multimnist-matrix-small", labels=labels), tmp / "multi", explain=False),
    }


@pytest.fixture(scope="module")
def client(few):
    with in_process_service(
        few["tmp"], CAPSERVE_MODEL=str(few["single"]), CAPSERVE_MULTILABEL_MODEL=str(few["multi"])
    ) as c:
        yield c


def test_classify_without_top_k_answers_every_label_of_a_small_model(few, client):
    n = len(few["labels"])
    r = client.post("/classify", **upload(random_png(0)))
    assert r.status_code == 200, r.text
    predictions = r.json()["predictions"]
    assert sorted(p["label"] for p in predictions) == sorted(few["labels"])  # up to 5: all n of them
    assert [p["probability"] for p in predictions] == sorted((p["probability"] for p in predictions), reverse=True)
    raw = client.post("/classify", content=random_png(0), headers={"content-type": "image/png"})
    assert raw.status_code == 200 and raw.json() == r.json()
    batch = client.post("/classify_batch", files=[("images", ("a.png", random_png(i), "image/png")) for i in (1, 2)])
    assert batch.status_code == 200, batch.text
    assert [len(answer["predictions"]) for answer in batch.json()] == [n, n]
    assert len(client.post("/classify", **upload(random_png(0)), data={"top_k": str(n)}).json()["predictions"]) == n


@pytest.mark.parametrize("route", ["/classify", "/classify_batch"])
def test_an_explicit_top_k_above_the_labels_is_still_refused(few, client, route):
    n = len(few["labels"])
    field = "images" if route == "/classify_batch" else "image"
    for sent in ({"data": {"top_k": str(n + 1)}}, {"params": {"top_k": "5"}}):
        r = client.post(route, files=[(field, ("a.png", random_png(0), "image/png"))], **sent)
        given = sent.get("data", sent.get("params"))["top_k"]
        assert r.status_code == 400 and r.json() == {
            "error": f"top_k={given} but the model has {n} labels: give 1..{n}"
        }, r.text


# the page's three calls (capserve/serving/ui/index.html): each sends the image alone, in the form field "image"
PAGE_CALLS = ("/classify", "/multilabel", "/explain")


def test_the_pages_requests_are_answered_for_a_small_model(few, client):
    """What the page sends, read off its script, answered by the server: no ``top_k`` (nor any other parameter)."""
    script = page_html().decode()
    form = re.search(r"const form = \(\) => \{(.*?)\};", script).group(1)
    assert re.findall(r"\.append\(\"(\w+)\"", form) == ["image"]  # the form holds the image and nothing else
    for route in PAGE_CALLS:
        assert f'call("{route}", {{ method: "POST", body: form() }})' in script
        r = client.post(route, files={"image": ("image", random_png(3), "image/png")})
        assert r.status_code == 200, (route, r.text)


def test_multilabel_answers_a_small_model(few, client):
    r = client.post("/multilabel", **upload(random_png(4)), data={"threshold": "0.5"})
    assert r.status_code == 200 and set(r.json()["probabilities"]) == set(few["labels"]), r.text


# ------------------------------------------------------------------------------------------ in a browser


@pytest.mark.slow
def test_the_page_answers_for_a_three_label_model(few, tmp_path):
    """The docs' demo case: a three-shape model served, an image uploaded on /ui, every label on the page."""
    if len(few["labels"]) != 3:
        pytest.skip("one model size is enough for the browser")
    from selenium.webdriver.support.ui import WebDriverWait

    driver = chromium()
    proc, url, log = start_server(tmp_path, CAPSERVE_MODEL=str(few["single"]), CAPSERVE_MULTILABEL_MODEL="none")
    try:
        wait_ready(proc, url, log)
        image = tmp_path / "shape.png"
        image.write_bytes(random_png(5))
        driver.get(f"{url}/ui")
        wait = WebDriverWait(driver, 90, poll_frequency=0.2)
        wait.until(lambda d: "3 labels" in d.find_element("id", "server").text)
        driver.find_element("id", "file").send_keys(str(image))
        wait.until(lambda d: d.find_element("id", "answer").text not in ("", "…") or d.find_element("id", "error").text)
        assert not driver.find_element("id", "error").is_displayed(), driver.find_element("id", "error").text
        assert driver.find_element("id", "answer").text in SHAPES
        rows = driver.find_elements("css selector", "#top-k .row")
        assert sorted(row.find_element("css selector", "span").text for row in rows) == sorted(SHAPES)
        wait.until(lambda d: d.execute_script("return document.getElementById('occlusion-map').naturalWidth"))
    finally:
        driver.quit()
        stop(proc)
