"""A real `bentoml serve` of the checkout's service.py for tests: start, wait, stop, upload, expected answers."""

from __future__ import annotations

import io
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

import capserve
from capserve.data.images import preprocess

ROOT = Path(__file__).resolve().parents[2]


BENTOML = str(Path(sys.executable).with_name("bentoml"))


MAX_BYTES = 300_000


MAX_PIXELS = 1_000_000


MAX_IMAGES = 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(tmp: Path, **env: str) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    log = tmp / f"server-{port}.log"
    # one worker unless a test says otherwise: a second one doubles start-up on a 2-core CI machine
    environ = {
        **os.environ,
        "BENTOML_HOME": str(tmp / "bentoml"),
        "BENTOML_DO_NOT_TRACK": "True",
        "CAPSERVE_WORKERS": "1",
        **env,
    }
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [BENTOML, "serve", "service:CapsuleService", "--host", "127.0.0.1", "--port", str(port)],
            cwd=ROOT,
            env=environ,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    return proc, f"http://127.0.0.1:{port}", log


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def wait_ready(proc: subprocess.Popen, url: str, log: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    stop(proc)
    pytest.fail(f"server not ready after {timeout} s:\n{log.read_text()[-3000:]}")


def export(model: capserve.CapsNet, directory: Path, explain: bool) -> Path:
    from capserve.export.onnx import export_onnx

    model.save(directory)
    export_onnx(model, directory / "model.onnx")
    if explain:
        export_onnx(model, directory / "model-explain.onnx", explain=True)
    return directory


def encode(pixels: np.ndarray, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, fmt)
    return buffer.getvalue()


def random_png(seed: int, size: tuple[int, int] = (32, 32), mode: str = "RGB") -> bytes:
    shape = (size[1], size[0], 3) if mode == "RGB" else (size[1], size[0])
    return encode(np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8))


def eager_logits(model: capserve.CapsNet, data: bytes) -> np.ndarray:
    x = preprocess(data, model.config)
    with torch.inference_mode():
        return model(torch.from_numpy(x)).numpy()[0]


def softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max())
    return e / e.sum()


def upload(data: bytes, field: str = "image", content_type: str = "image/png") -> dict:
    return {"files": {field: ("upload.png", data, content_type)}}


def requests_total(client: httpx.Client, endpoint: str) -> float:
    """BentoML's request count of ``endpoint`` on ``/metrics`` (every status, every worker)."""
    total = 0.0
    for line in client.get("/metrics").text.replace(", ", ",").splitlines():
        if line.startswith("bentoml_service_request_total{") and f'endpoint="{endpoint}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def error_of(response: httpx.Response) -> str:
    """The message of an error response, which must be exactly one JSON object {"error": "..."}."""
    assert response.headers["content-type"] == "application/json", response.headers
    body = response.json()
    assert isinstance(body, dict) and list(body) == ["error"] and isinstance(body["error"], str), body
    assert body["error"].strip(), body
    return body["error"]


# ------------------------------------------------------------------------------------------ start-up


def failed_start(tmp: Path, **env: str) -> str:
    """Start a server that cannot load its model: it must stop by itself with exit status 3 (not 0, which
    supervisors and orchestrators read as success; not respawning its worker forever)."""
    proc, _, log = start_server(tmp, **{"CAPSERVE_MULTILABEL_MODEL": "none", **env})
    try:
        proc.wait(90)
    except subprocess.TimeoutExpired:
        stop(proc)
        pytest.fail(f"the server kept running with a broken model:\n{log.read_text()[-2000:]}")
    text = log.read_text()
    assert proc.returncode == 3, f"exit status {proc.returncode}:\n{text[-2000:]}"
    assert "capserve cannot start" in text
    return text


@dataclass
class Drain:
    """What a SIGTERM under load did: each in-flight request's status (or the error that ended it), when the last
    one ended, when the signal went, the exit status and how long the stop took."""

    answers: list[int | str]
    last_answer: float
    stopped: float
    code: int | None
    took: float


def requests_seen(url: str, route: str) -> tuple[float, float]:
    """(in flight, answered) requests to ``route``: BentoML's ``bentoml_service_request_in_progress`` gauge and
    ``bentoml_service_request_total`` counter on /metrics, summed over workers and status codes."""
    running = answered = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if f'endpoint="{route}"' in line:
            if line.startswith("bentoml_service_request_in_progress{"):
                running += float(line.rsplit(" ", 1)[1])
            elif line.startswith("bentoml_service_request_total{"):
                answered += float(line.rsplit(" ", 1)[1])
    return running, answered


def stop_under_load(proc: subprocess.Popen, url: str, grace: float, requests: int = 6, images: int = 32) -> Drain:
    """SIGTERM to a ready server once all ``requests`` /classify_batch requests of ``images`` images have reached it
    and some still run, then wait up to ``grace`` seconds (a pod's grace period) for the requests and the exit
    (killed after that). A machine fast enough to answer them all before the signal could go gets a new round with
    twice the images, so that the stop always meets requests in flight and none still on its way."""
    answers: list[int | str] = []
    ended: list[float] = []

    def send(files: list) -> None:
        try:
            answers.append(httpx.post(f"{url}/classify_batch", files=files, timeout=120).status_code)
        except httpx.HTTPError as e:  # a dropped connection, not an answer
            answers.append(type(e).__name__)
        ended.append(time.monotonic())

    httpx.post(f"{url}/classify", **upload(random_png(0)), timeout=60).raise_for_status()  # warm
    for round_ in range(5):
        files = [("images", ("x.png", random_png(i), "image/png")) for i in range(images << round_)]
        answers.clear()
        ended.clear()
        _, before = requests_seen(url, "/classify_batch")
        senders = [threading.Thread(target=send, args=(files,)) for _ in range(requests)]
        for t in senders:
            t.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            running, answered = requests_seen(url, "/classify_batch")
            if running + answered - before >= requests:  # all of them reached the server
                break
            time.sleep(0.005)
        if running >= 1:
            break
        for t in senders:  # all answered before the signal could go: again, heavier
            t.join(timeout=120)
    else:
        raise AssertionError(f"{requests} requests to /classify_batch never met a stop while some were in flight")
    stopped = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    for t in senders:
        t.join(timeout=grace)
    try:
        code = proc.wait(timeout=max(grace - (time.monotonic() - stopped), 1))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        code = None
    return Drain(answers, max(ended, default=0.0), stopped, code, time.monotonic() - stopped)


def grace_period(manifest: Path) -> int:
    """The pod's ``terminationGracePeriodSeconds`` (Kubernetes' default 30 when the manifest sets none)."""
    import yaml

    for doc in yaml.safe_load_all(manifest.read_text()):
        if doc and doc.get("kind") == "Deployment":
            return doc["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 30)
    raise AssertionError(f"no Deployment in {manifest}")
