"""Core shares between CPU workers (capserve.serving.cores): a lone request borrows idle workers' cores, and the
cores are never oversubscribed. Each worker's side is its own ``CoreShares`` over one folder, as in a server."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from pathlib import Path

import numpy as np
from support.server import random_png

from capserve.serving import Capsules, Settings
from capserve.serving import workers as W
from capserve.serving.cores import CORES_FOLDER_VARIABLE, CoreShares, core_shares


def shares(folder: Path, count: int) -> list[CoreShares]:
    return [CoreShares(folder, k, count) for k in range(count)]


def in_a_thread(enter) -> tuple[threading.Event, threading.Thread]:
    """Go through ``enter()`` (a context manager) in another thread: the event is set once it is in."""
    inside = threading.Event()

    def go() -> None:
        with enter():
            inside.set()

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    return inside, thread


def test_a_lone_inference_borrows_idle_workers_cores_and_peers_wait_for_it(tmp_path):
    first, second = shares(tmp_path, 2)
    with first.running(wide=True) as borrowed:
        assert borrowed
        peer, own = in_a_thread(second.running), in_a_thread(first.running)
        assert not peer[0].wait(0.3)  # its cores are lent: it waits
        assert not own[0].wait(0.1)  # the worker's own other work waits too
    for inside, thread in (peer, own):  # both get in once the borrowed inference ends
        assert inside.wait(5)
        thread.join(5)
    with first.running(wide=True) as borrowed:  # released: lent again
        assert borrowed


def test_no_borrowing_from_a_busy_worker_or_beside_the_workers_own_work(tmp_path):
    first, second = shares(tmp_path, 2)
    with second.running(), first.running(wide=True) as borrowed:  # the peer runs: no wait, its own share only
        assert not borrowed
    with first.running(), first.running(wide=True) as borrowed:  # not this worker's only inference
        assert not borrowed
    with first.running(wide=True) as borrowed:
        assert borrowed


def test_no_borrowing_while_a_peer_has_requests_in_progress(tmp_path):
    """A peer between two batches holds no lock but is not idle: lending it would cost its next batch."""
    first, second = shares(tmp_path, 2)
    second.requests(3)
    with first.running(wide=True) as borrowed:
        assert not borrowed
    first.requests(1)  # its own count does not stop it
    second.requests(0)
    with first.running(wide=True) as borrowed:
        assert borrowed


def test_all_or_nothing_borrowing_across_three_workers(tmp_path):
    first, second, third = shares(tmp_path, 3)
    with third.running(), first.running(wide=True) as borrowed:
        assert not borrowed
        inside, _ = in_a_thread(second.running)
        assert inside.wait(5)  # the lock taken from `second` was given back


def test_cores_are_never_oversubscribed_under_random_load(tmp_path):
    """Many threads per worker, some asking to borrow: a borrowed inference is always the only one running."""
    workers = shares(tmp_path, 3)
    lock, active, borrowed_runs, overlaps = threading.Lock(), [0], [0], []
    wide_now = [False]

    def inference(worker: CoreShares, seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(40):
            time.sleep(rng.random() * 3e-3)  # idle now and then, so that borrowing happens
            with worker.running(wide=rng.random() < 0.5) as borrowed:
                with lock:
                    active[0] += 1
                    if wide_now[0] or (borrowed and active[0] > 1):
                        overlaps.append(active[0])
                    wide_now[0] = wide_now[0] or borrowed
                    borrowed_runs[0] += borrowed
                time.sleep(rng.random() * 1e-3)
                with lock:
                    active[0] -= 1
                    wide_now[0] = wide_now[0] and not borrowed

    threads = [
        threading.Thread(target=inference, args=(w, 10 * k + i)) for k, w in enumerate(workers) for i in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "deadlock"
    assert not overlaps
    assert borrowed_runs[0] > 0  # some inferences did find every peer idle


def test_core_shares_only_for_several_cpu_workers_of_a_server(tmp_path, monkeypatch):
    monkeypatch.setenv(CORES_FOLDER_VARIABLE, str(tmp_path))
    assert core_shares(W.Worker(0, 1, "cpu", 2)) is None
    assert core_shares(W.Worker(0, 2, "cuda:0", 1)) is None
    assert isinstance(core_shares(W.Worker(1, 2, "cpu", 1)), CoreShares)
    monkeypatch.delenv(CORES_FOLDER_VARIABLE)
    assert core_shares(W.Worker(1, 2, "cpu", 1)) is None  # a Capsules made outside a server


def test_a_lone_request_runs_on_every_workers_threads_when_the_peer_is_idle(tiny_cifar10, tmp_path, monkeypatch):
    monkeypatch.setenv(CORES_FOLDER_VARIABLE, str(tmp_path))
    capsules = Capsules(Settings(model=str(tiny_cifar10), multilabel_model="none"), worker=W.Worker(0, 2, "cpu", 1))
    wide = capsules.cores.wide[False]
    assert wide.session.get_session_options().intra_op_num_threads == 2  # both workers' threads, no more
    assert capsules.runtime.session.get_session_options().intra_op_num_threads == 1
    assert capsules.describe()["lone_request_threads"] == 2

    peer = CoreShares(tmp_path, 1, 2)
    ran: list[tuple[str, bool]] = []  # (session, whether the peer saw a request of ours in progress)
    for name, runtime in (("own", capsules.runtime), ("borrowed", wide)):

        def spy(x: np.ndarray, predict=runtime.predict, name=name) -> np.ndarray:
            ran.append((name, not peer.peers_idle()))
            return predict(x)

        monkeypatch.setattr(runtime, "predict", spy)
    size = capsules.runtime.metadata.image_size
    png = random_png(0, (size, size))
    first = asyncio.run(capsules.upload_logits(png))
    with peer.running():  # the other worker is busy: this one keeps to its own core, with the same answer
        second = asyncio.run(capsules.upload_logits(png))
    assert ran == [("borrowed", True), ("own", True)]
    assert np.allclose(first, second, atol=1e-5)
    assert peer.peers_idle() is True  # nothing of ours in progress any more


def test_one_worker_has_nothing_to_borrow(tiny_cifar10, tmp_path, monkeypatch):
    monkeypatch.setenv(CORES_FOLDER_VARIABLE, str(tmp_path))
    capsules = Capsules(Settings(model=str(tiny_cifar10), multilabel_model="none"), worker=W.Worker(0, 1, "cpu", 2))
    assert capsules.cores.shares is None and not capsules.cores.wide
    assert capsules.describe()["lone_request_threads"] == 2
