"""Faults a server on a cluster node meets: a stop (SIGTERM, what Kubernetes sends before its grace period ends)
while requests are in flight. Against the real `bentoml serve`, on loopback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from support.server import (
    free_port,
    grace_period,
    random_png,
    start_server,
    stop,
    stop_under_load,
    upload,
    wait_ready,
)

ROOT = Path(__file__).resolve().parents[2]
IN_FLIGHT = 6  # concurrent requests when the stop comes, each a batch of images


def capserve_serve(tmp: Path, model: Path, **env: str) -> tuple[subprocess.Popen, str, Path]:
    """``capserve serve MODEL`` as a user starts it: the CLI in front of `bentoml serve`."""
    port, log = free_port(), tmp / "capserve-serve.log"
    environ = {**os.environ, "BENTOML_HOME": str(tmp / "bentoml"), "BENTOML_DO_NOT_TRACK": "True", **env}
    command = [str(Path(sys.executable).with_name("capserve")), "serve", str(model), "--host", "127.0.0.1"]
    with open(log, "wb") as out:
        proc = subprocess.Popen([*command, "--port", str(port)], env=environ, stdout=out, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}", log


@pytest.mark.parametrize("launcher", ["bentoml serve", "capserve serve"])
def test_sigterm_answers_the_requests_in_flight_then_exits_0_within_the_grace_period(tiny_cifar10, tmp_path, launcher):
    grace = grace_period(ROOT / "deploy" / "kubernetes" / "deployment-cpu.yaml")
    env = {"CAPSERVE_WORKERS": "1", "CAPSERVE_MAX_IMAGES": "32"}
    if launcher == "bentoml serve":
        proc, url, log = start_server(tmp_path, CAPSERVE_MODEL=str(tiny_cifar10), **env)
    else:
        proc, url, log = capserve_serve(tmp_path, tiny_cifar10, **env)
    try:
        wait_ready(proc, url, log)
        drain = stop_under_load(proc, url, grace, IN_FLIGHT)
    finally:
        stop(proc)
    assert drain.answers == [200] * IN_FLIGHT, (drain.answers, log.read_text()[-3000:])
    assert drain.last_answer > drain.stopped, "every request ended before the stop: nothing was in flight"
    assert drain.code == 0, log.read_text()[-3000:]
    assert drain.took < grace, f"{drain.took:.1f} s to stop, the pod's grace period is {grace} s"
    with pytest.raises(httpx.ConnectError):  # a stopped server refuses new connections
        httpx.get(f"{url}/readyz", timeout=5)


def workers_of(server: subprocess.Popen) -> set[int]:
    """The worker processes of a `bentoml serve` (its children)."""
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(server.pid)], capture_output=True, text=True).stdout
    return {int(pid) for pid in out.split()}


def worker_starts(url: str) -> dict[str, float]:
    """``capserve_worker_starts_total`` per worker index, from /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        line.split('worker="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("capserve_worker_starts_total{")
    }


CLIENTS = 4  # concurrent clients of the load, each one request at a time


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the workers with ps --ppid (Linux)")
def test_a_worker_killed_under_load_costs_only_its_requests_in_flight_and_comes_back(tiny_cifar10, tmp_path):
    """kill -9 of one of two workers while clients send requests: the server keeps answering, the requests lost are
    at most those in flight (one per client, each a dropped connection at once, never a hang), the worker is
    started again, and /metrics counts its second start while /readyz stays 200 (the other worker answers)."""
    proc, url, log = start_server(tmp_path, CAPSERVE_MODEL=str(tiny_cifar10), CAPSERVE_WORKERS="2")
    outcomes: list[int | str] = []
    longest = [0.0]
    running = threading.Event()
    running.set()

    def client() -> None:
        with httpx.Client(timeout=30) as c:
            while running.is_set():
                start = time.monotonic()
                try:
                    outcomes.append(c.post(f"{url}/classify", **upload(random_png(len(outcomes)))).status_code)
                except httpx.TimeoutException:
                    outcomes.append("timeout")
                except httpx.HTTPError:  # the connection the dead worker held
                    outcomes.append("dropped")
                longest[0] = max(longest[0], time.monotonic() - start)

    try:
        wait_ready(proc, url, log)
        deadline = time.monotonic() + 60
        while worker_starts(url) != {"0": 1.0, "1": 1.0} and time.monotonic() < deadline:  # both workers up
            time.sleep(0.3)
        before = workers_of(proc)
        assert len(before) == 2 and worker_starts(url) == {"0": 1.0, "1": 1.0}
        clients = [threading.Thread(target=client) for _ in range(CLIENTS)]
        for t in clients:
            t.start()
        time.sleep(2)
        answered_before = len(outcomes)
        victim = min(before)
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        ready = []
        while time.monotonic() - killed < 60 and len(workers_of(proc) - before) < 1:  # a process started again
            ready.append(httpx.get(f"{url}/readyz", timeout=10).status_code)
            time.sleep(0.2)
        deadline = time.monotonic() + 60
        while sum(worker_starts(url).values()) < 3 and time.monotonic() < deadline:  # the new one initialised
            time.sleep(0.3)
        recovered = time.monotonic() - killed
        time.sleep(1)
        running.clear()
        for t in clients:
            t.join(timeout=60)
        starts = worker_starts(url)
        alive = proc.poll() is None
    finally:
        running.clear()
        stop(proc)
    assert alive, log.read_text()[-3000:]
    assert recovered < 60, f"no worker started again within 60 s of the kill:\n{log.read_text()[-3000:]}"
    assert set(ready) == {200}, ready  # the other worker kept the server ready
    lost = [o for o in outcomes if o != 200]
    assert set(lost) <= {"dropped"} and len(lost) <= CLIENTS, lost  # no timeout, no 5xx: the in-flight ones only
    assert len(outcomes) > answered_before + 4 * CLIENTS  # and it went on answering
    assert longest[0] < 30  # nothing hung until the client's timeout
    assert sorted(starts.values()) == [1.0, 2.0], starts  # the killed worker's second start
