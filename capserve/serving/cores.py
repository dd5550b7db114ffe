"""Core shares: the workers of one CPU server lend each other their idle cores, without oversubscription.

With N workers on C cores each worker owns C ÷ N of them (capserve.serving.workers). A lone request in one worker
would then run on its share only while the other workers sit idle, slower than one worker with every core would
answer it (docs/deploy.md, "Workers"). So a worker may borrow the others' shares for a lone request, when none of
them is running anything, and the cores are never oversubscribed:

- a worker holds a lock on its own share (one file per worker, ``flock``) while any inference of its own runs;
- a lone request borrows only when no other worker has a request in progress (each worker publishes its count in
  a shared table, ``requests``): under load a peer between two batches is not idle, and a batch-1 inference on
  borrowed cores would cost it more than it saves;
- it then takes every other worker's lock without waiting; if one is held, it runs on its own share;
- a worker that gets work while its share is lent waits for that one inference to end (milliseconds).

Locks are ``flock``s on files in one folder per server (``CORES_FOLDER_VARIABLE``, made by the server process and
inherited by its workers): the kernel drops them when a worker dies, so a crashed worker cannot hold cores.

BentoML 1.4.40 has no way to share cores between its workers, and ``multiprocessing`` locks need a common parent
that made them, while BentoML's workers are started by its process manager (circus), so the locks are written
here. To tell when BentoML offers it: a CPU-sharing option among ``@bentoml.service``'s ``resources``/``workers``.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from capserve.runtime import Runtime, load_runtime
from capserve.serving.batching import lone_request_options
from capserve.serving.settings import Settings
from capserve.serving.workers import Worker

# the server process makes the folder and its workers inherit this variable (capserve.serving.process)
CORES_FOLDER_VARIABLE = "CAPSERVE_CORES_FOLDER"


class CoreShares:
    """Worker ``index`` of ``count``'s side of the core locks in ``folder`` (one ``worker-K.lock`` per worker).

    ``running(wide=True)`` around an inference holds this worker's share, and also every other worker's when they
    are all idle and nothing else runs in this worker: it yields whether it got them (then the caller may run on
    all the cores). Thread-safe: the server runs inference in worker threads.
    """

    def __init__(self, folder: Path, index: int, count: int):
        if not 0 <= index < count:
            raise ValueError(f"worker index {index} is not in 0..{count - 1}")
        folder.mkdir(parents=True, exist_ok=True)
        # one open file per worker's lock: flock locks belong to an open file, so other workers' opens conflict
        self._files = [os.open(folder / f"worker-{k}.lock", os.O_RDWR | os.O_CREAT, 0o600) for k in range(count)]
        self._own, self._others = self._files[index], [f for k, f in enumerate(self._files) if k != index]
        # requests in progress per worker (int64 each): written by its own event loop only, read by the others
        table = os.open(folder / "requests", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(table).st_size < 8 * count:
                os.ftruncate(table, 8 * count)  # zeros; every worker does this with the same size
            self._table = mmap.mmap(table, 8 * count)
        finally:
            os.close(table)
        self._requests = memoryview(self._table).cast("q")
        self._index = index
        self._state = threading.Condition()
        self._running = 0  # this worker's inferences in flight
        self._borrowed = False  # one of them runs on every worker's cores: the others here wait

    def requests(self, count: int) -> None:
        """Publish how many requests this worker has in progress (decoding, queued or running)."""
        self._requests[self._index] = count

    def peers_idle(self) -> bool:
        """Whether no other worker has a request in progress."""
        return not any(n for k, n in enumerate(self._requests) if k != self._index)

    @contextmanager
    def running(self, wide: bool = False) -> Iterator[bool]:
        """Hold this worker's cores for one inference (waiting while a peer has borrowed them); with ``wide``,
        borrow every other worker's too if each is idle and this is the worker's only inference. Yields whether
        it borrowed them."""
        with self._state:
            self._state.wait_for(lambda: not self._borrowed)
            if self._running == 0:
                fcntl.flock(self._own, fcntl.LOCK_EX)  # waits only while a peer runs a borrowed inference
            self._running += 1
            self._borrowed = borrowed = wide and self._running == 1 and self.peers_idle() and self._borrow()
        try:
            yield borrowed
        finally:
            with self._state:
                if borrowed:
                    for f in self._others:
                        fcntl.flock(f, fcntl.LOCK_UN)
                    self._borrowed = False
                self._running -= 1
                if self._running == 0:
                    fcntl.flock(self._own, fcntl.LOCK_UN)
                self._state.notify_all()

    def _borrow(self) -> bool:
        """Every other worker's lock, taken without waiting: all of them, or none."""
        taken: list[int] = []
        for f in self._others:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                for g in taken:
                    fcntl.flock(g, fcntl.LOCK_UN)
                return False
            taken.append(f)
        return True

    def close(self) -> None:
        self._requests.release()
        self._table.close()
        for f in self._files:
            os.close(f)


def core_shares(worker: Worker) -> CoreShares | None:
    """``worker``'s side of its server's core locks: for two or more workers on a CPU started by a capserve server
    process (which made the folder); None otherwise (one worker, GPUs, a ``Capsules`` made outside a server)."""
    folder = os.environ.get(CORES_FOLDER_VARIABLE)
    if worker.count < 2 or worker.device != "cpu" or not folder:
        return None
    return CoreShares(Path(folder), worker.index, worker.count)


def borrowing_runtime(runtime: Runtime, settings: Settings, worker: Worker) -> Runtime | None:
    """The session a lone request runs on when its worker has borrowed the other workers' idle cores: the same ONNX
    Runtime graph on every worker's threads together (so never more than the server's), spinning like the
    lone-request session. None for other backends: torch's threads are set for the whole process, and TensorRT
    serves on GPUs."""
    if runtime.backend != "onnxruntime" or settings.device != "cpu":
        return None
    options = {**lone_request_options(settings), "threads": worker.threads * worker.count}
    return load_runtime(runtime.path, "onnxruntime", settings.device, **options)


class CoreLending:
    """One worker's side of core lending, as the request logic uses it.

    ``shares`` is its ``CoreShares`` (None with nothing to share: one worker, GPUs, a ``Capsules`` made outside a
    server); ``wide`` maps each served model (keyed as in ``runtimes``) to its ``borrowing_runtime``, for models
    that can borrow; ``threads`` is what a lone request may run on. ``requests(n)`` publishes the worker's requests
    in progress, and ``running(wide)`` goes around each inference (see ``CoreShares.running``).
    """

    def __init__(self, worker: Worker, settings: Settings, runtimes: Mapping[bool, Runtime | None]):
        self.shares = core_shares(worker)
        self.wide: dict[bool, Runtime] = {}
        for key, runtime in runtimes.items():
            wide = borrowing_runtime(runtime, settings, worker) if self.shares and runtime else None
            if wide is not None:
                self.wide[key] = wide
        self.threads = worker.threads * worker.count if self.wide else worker.threads

    def requests(self, count: int) -> None:
        """Tell the other workers how many requests this one has in progress: a lone request borrows their cores
        only when none has any."""
        if self.shares:
            self.shares.requests(count)

    def running(self, wide: bool = False) -> contextlib.AbstractContextManager[bool]:
        """Around each inference: this worker's share of the cores (with ``wide``, every worker's when the others
        are idle; yields whether it got them). Nothing to share: never wide."""
        return self.shares.running(wide) if self.shares else contextlib.nullcontext(False)
