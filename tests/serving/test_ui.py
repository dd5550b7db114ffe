"""The service's web page at /ui: in a real browser (headless Chromium, ``support.browser``) against one real
``bentoml serve`` of the shipped models with an API key, as a person uses it (type the key, upload an image, read
the answer), and without a browser for what the server sends (the page, its headers, the setting that turns it
off)."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import httpx
import pytest
from support.browser import chromium
from support.inprocess import in_process_service
from support.real_images import cifar10, png
from support.server import ROOT, random_png, start_server, stop, wait_ready

KEY = "page-test-key-0123"


CIFAR10_LABELS = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")


# ------------------------------------------------------------------------------------------ without a browser


def test_the_page_is_one_file_that_loads_nothing_from_elsewhere(tiny_cifar10, tmp_path):
    """...and needs no key itself (it holds no data), where the API it calls does."""
    with in_process_service(
        tmp_path, CAPSERVE_MODEL=str(tiny_cifar10), CAPSERVE_MULTILABEL_MODEL="none", CAPSERVE_API_KEYS=KEY
    ) as client:
        assert client.get("/model").status_code == 401
        page = client.get("/ui/")
        assert page.status_code == 200, page.text
        assert page.headers["content-type"].startswith("text/html")
        policy = page.headers["content-security-policy"]
        assert "default-src 'none'" in policy and "connect-src 'self'" in policy
        html = page.text
        assert not re.search(r"(src|href)\s*=\s*[\"']?(https?:)?//", html), "the page loads something from elsewhere"
        assert not re.search(r"@import|url\(", html)
        assert html.count('"src": "data:image/png;base64,') >= 4  # the bundled examples, inlined
        assert client.get("/model", headers={"Authorization": f"Bearer {KEY}"}).json()["ui"] is True
        refused = client.post("/ui/", content=b"x")
        assert refused.status_code == 405 and list(refused.json()) == ["error"]


def test_a_setting_turns_the_page_off(tiny_cifar10, tmp_path):
    with in_process_service(
        tmp_path, CAPSERVE_MODEL=str(tiny_cifar10), CAPSERVE_MULTILABEL_MODEL="none", CAPSERVE_UI="0"
    ) as client:
        assert client.get("/model").json()["ui"] is False
        gone = client.get("/ui/")
        assert gone.status_code == 404 and list(gone.json()) == ["error"]


# ------------------------------------------------------------------------------------------ in a browser


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    """The page's address on a real server of the shipped models that needs ``KEY``."""
    tmp = tmp_path_factory.mktemp("page")
    proc, url, log = start_server(tmp, CAPSERVE_API_KEYS=KEY, CAPSERVE_MAX_BATCH_SIZE="8")
    try:
        wait_ready(proc, url, log)
        yield f"{url}/ui"
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def browser(page):
    driver = chromium()
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(browser, condition, timeout: float = 90):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(browser, timeout, poll_frequency=0.2).until(lambda _: condition())


def text(browser, element_id: str) -> str:
    return browser.find_element("id", element_id).text


def shown(browser, element_id: str) -> bool:
    return browser.find_element("id", element_id).is_displayed()


# Drops (or pastes) the bundled example arguments[1] as a PNG file, as a person's drag or Ctrl+V hands it over.
HAND_OVER = """
const [event, name] = arguments;
const example = [...document.querySelectorAll('#examples img')].find((img) => img.alt === name);
fetch(example.src).then((r) => r.blob()).then((blob) => {
  const files = new DataTransfer();
  files.items.add(new File([blob], name + '.png', {type: 'image/png'}));
  const init = {bubbles: true, cancelable: true};
  if (event === 'drop') {
    document.getElementById('drop').dispatchEvent(new DragEvent('drop', {...init, dataTransfer: files}));
  } else {
    document.dispatchEvent(new ClipboardEvent('paste', {...init, clipboardData: files}));
  }
});
"""


def open_with_key(browser, page: str, key: str = KEY) -> None:
    """Load the page afresh (which forgets any key) and type ``key`` into its prompt."""
    browser.get(page)
    wait_for(browser, lambda: shown(browser, "key-panel"))
    browser.find_element("id", "api-key").send_keys(key)
    browser.find_element("id", "key-save").click()


def upload(browser, path: Path) -> None:
    browser.find_element("id", "file").send_keys(str(path))


@pytest.mark.slow
def test_the_page_labels_a_real_cifar10_image(page, browser, tmp_path):
    images, labels = cifar10()
    k = 63  # a dog, not one of the page's bundled examples
    image = tmp_path / f"cifar10-test-{k}.png"
    image.write_bytes(png(images[k]))
    open_with_key(browser, page)
    wait_for(browser, lambda: not shown(browser, "key-panel") and "cifar10-resnet" in text(browser, "server"))
    upload(browser, image)
    wait_for(browser, lambda: text(browser, "answer") not in ("", "…"))
    assert text(browser, "answer") == "dog" == CIFAR10_LABELS[labels[k]]
    rows = browser.find_elements("css selector", "#top-k .row")
    assert len(rows) == 5 and rows[0].text.startswith("dog")
    wait_for(browser, lambda: len(browser.find_elements("css selector", "#multilabel-rows .row")) == 10)
    wait_for(browser, lambda: browser.execute_script("return document.getElementById('occlusion-map').naturalWidth"))
    assert browser.execute_script("return document.getElementById('routing-map').naturalWidth") == 256
    assert "selectivity" in text(browser, "routing-caption") and "dog" in text(browser, "occlusion-caption")
    assert not shown(browser, "error") and not shown(browser, "unfamiliar")  # a photograph like those it learned
    assert "unfamiliarity 0." in text(browser, "answer-model")
    shot = tmp_path / "ui.png"
    browser.save_screenshot(str(shot))
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get("CAPSERVE_UI_SCREENSHOT"):  # docs/serving.md's picture: CAPSERVE_UI_SCREENSHOT=docs/images/ui.png
        shutil.copyfile(shot, ROOT / os.environ["CAPSERVE_UI_SCREENSHOT"])


@pytest.mark.slow
def test_the_page_asks_for_a_key_and_keeps_it_in_memory_only(page, browser):
    """A wrong key is refused with the server's message; the right one serves the page's calls (a bundled example
    clicked, dropped and pasted); nothing stores it, and a reload forgets it."""
    open_with_key(browser, page, key="not-the-key-0000")
    wait_for(browser, lambda: "not valid" in text(browser, "key-message"))
    assert shown(browser, "key-panel")
    browser.find_element("id", "api-key").send_keys(KEY)
    browser.find_element("id", "key-save").click()
    wait_for(browser, lambda: not shown(browser, "key-panel"))
    browser.find_element("css selector", '#examples button[data-name="cat"]').click()  # a bundled example, with the key
    wait_for(browser, lambda: text(browser, "answer") == "cat")
    for event, name in (("drop", "ship"), ("paste", "airplane")):  # an image dropped on the box, one pasted
        browser.execute_script(HAND_OVER, event, name)
        wait_for(browser, lambda name=name: text(browser, "answer") == name)
    assert browser.execute_script("return localStorage.length + sessionStorage.length + document.cookie.length") == 0
    browser.get(page)  # a reload forgets the key
    wait_for(browser, lambda: shown(browser, "key-panel"))
    assert "needs an API key" in text(browser, "key-message")


@pytest.mark.slow
def test_an_error_shows_the_servers_message(page, browser, tmp_path):
    bad = tmp_path / "not-an-image.png"
    bad.write_bytes(b"these bytes are not an image")
    expected = httpx.post(
        page.removesuffix("/ui") + "/classify",
        files={"image": ("not-an-image.png", bad.read_bytes(), "image/png")},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    )
    assert expected.status_code == 400
    open_with_key(browser, page)
    wait_for(browser, lambda: not shown(browser, "key-panel"))
    upload(browser, bad)
    wait_for(browser, lambda: shown(browser, "error"))
    assert expected.json()["error"] in text(browser, "error")
    assert text(browser, "answer") == ""


@pytest.mark.slow
def test_the_page_says_plainly_when_an_image_is_unlike_anything_the_model_learned(page, browser, tmp_path):
    """Noise is unlike the photographs the shipped model learned from: above its answer, in a box of its own, the
    page says so (the server's ``unfamiliar``); a photograph after it clears the box."""
    noise = tmp_path / "noise.png"
    noise.write_bytes(random_png(0))
    answer = httpx.post(
        page.removesuffix("/ui") + "/classify",
        files={"image": ("noise.png", noise.read_bytes(), "image/png")},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    ).json()
    assert answer["unfamiliar"] is True
    open_with_key(browser, page)
    wait_for(browser, lambda: not shown(browser, "key-panel"))
    upload(browser, noise)
    wait_for(browser, lambda: shown(browser, "unfamiliar"))
    banner = text(browser, "unfamiliar")
    assert "unlike anything cifar10-resnet learned from" in banner and f"{answer['unfamiliarity']:.1f}" in banner
    assert browser.find_element("id", "unfamiliar").get_attribute("role") == "alert"
    images, _ = cifar10()
    photo = tmp_path / "photo.png"
    photo.write_bytes(png(images[63]))
    upload(browser, photo)
    wait_for(browser, lambda: text(browser, "answer") == "dog")
    assert not shown(browser, "unfamiliar")
