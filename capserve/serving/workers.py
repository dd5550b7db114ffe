"""Workers: how many server processes (``CAPSERVE_WORKERS``) and each one's share of the machine.

BentoML runs ``workers`` copies of the service, each its own process with its own event loop, models and sessions.
Each is told its share here: on GPUs, worker k serves on visible GPU k (round robin when there are more workers than
GPUs); on CPUs the cores are split, so that N workers never run more inference threads than there are cores.

BentoML 1.4.40 cannot decide either: its ``workers`` is a number or ``cpu_count`` (one per core), never one per GPU;
``resources={"gpu": N}`` gives every worker the same ``CUDA_VISIBLE_DEVICES`` (``_bentoml_impl.server.allocator``);
and its ``threads`` bounds the thread pool of synchronous APIs, not a runtime's intra-op threads. The number decided
here is what the service passes to BentoML as ``workers``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass

from capserve.errors import ConfigurationError
from capserve.hardware import available_cores
from capserve.serving.settings import Settings

__all__ = ["AUTO_CPU_WORKERS", "Worker", "assign", "current_index", "on_gpu", "visible_gpus", "worker_count"]

# What CAPSERVE_WORKERS=auto (the default) starts on a CPU without a tuned file measured there: one worker, with
# every core. More workers are not safe unmeasured: BentoML's workers share one listening socket, keep-alive
# connections stay with the worker that accepted them, and one worker can hold most of them while each has only
# its share of the cores (docs/deploy.md, "Workers"). `capserve tune` measures whether more workers pay here.
AUTO_CPU_WORKERS = 1


def visible_gpus(env: Mapping[str, str] | None = None) -> int:
    """How many GPUs this process may use: ``CUDA_VISIBLE_DEVICES`` when set (as CUDA reads it: the list ends at
    the first invalid entry, so "" and "-1" hide every GPU), else NVIDIA's management library's count (the GPU
    image has the CPU build of torch, so torch cannot count them); 0 without NVIDIA's driver."""
    env = os.environ if env is None else env
    if "CUDA_VISIBLE_DEVICES" in env:
        count = 0
        for entry in env["CUDA_VISIBLE_DEVICES"].split(","):
            entry = entry.strip()
            if not entry or entry.startswith("-"):
                break
            count += 1
        return count
    try:
        from bentoml._internal.resource import NvidiaGpuResource
    except ImportError:
        return 0
    return len(NvidiaGpuResource.from_system())


def on_gpu(settings: Settings) -> bool:
    return settings.device == "cuda" or settings.device.startswith("cuda:")


def worker_count(settings: Settings, gpus: int | None = None) -> int:
    """``CAPSERVE_WORKERS`` resolved: the number given (or the tuned file's, capserve.serving.tuned), or for
    ``auto`` one worker per visible GPU when serving on ``cuda`` (one for a named ``cuda:N``), and on a CPU
    ``AUTO_CPU_WORKERS``."""
    if settings.workers is not None:
        return settings.workers
    if settings.device.startswith("cuda:"):
        return 1
    if on_gpu(settings):
        gpus = visible_gpus() if gpus is None else gpus
        if gpus == 0:
            raise ConfigurationError(
                "CAPSERVE_WORKERS=auto with CAPSERVE_DEVICE=cuda, but no GPU is visible (check "
                "nvidia-smi and CUDA_VISIBLE_DEVICES, and the pod's nvidia.com/gpu request); "
                "set CAPSERVE_DEVICE=cpu, or CAPSERVE_WORKERS to a number"
            )
        return gpus
    return AUTO_CPU_WORKERS


@dataclass(frozen=True)
class Worker:
    """One server process's share: its index (0 .. count - 1), the device it serves on and its intra-op threads."""

    index: int
    count: int
    device: str
    threads: int

    def settings(self, settings: Settings) -> Settings:
        """``settings`` for this worker: its device and its threads."""
        return dataclasses.replace(settings, device=self.device, threads=self.threads)


def assign(settings: Settings, index: int, count: int, cores: int | None = None) -> Worker:
    """Worker ``index`` of ``count``'s share: on ``cuda``, visible GPU ``index`` (modulo the GPUs when there are
    fewer; a named ``cuda:N`` is every worker's); intra-op threads ``CAPSERVE_THREADS``, else cores ÷ workers."""
    if not 0 <= index < count:
        raise ValueError(f"worker index {index} is not in 0..{count - 1}")
    device = settings.device
    if device == "cuda" and count > 1:  # one worker keeps "cuda": the current device
        device = f"cuda:{index % max(1, visible_gpus())}"
    cores = available_cores() if cores is None else cores
    threads = settings.threads or max(1, cores // count)
    return Worker(index, count, device, threads)


def current_index() -> int:
    """This process's worker index from 0 (0 outside a BentoML worker).

    BentoML 1.4.40 has no public worker index: this reads ``bentoml._internal.context.server_context.worker_index``,
    which numbers workers from 1 (None outside a worker). tests/serving/test_workers.py's
    ``test_two_workers_answer_split_the_cores_and_share_metrics`` fails when that changes."""
    from bentoml._internal.context import server_context

    return (server_context.worker_index or 1) - 1
