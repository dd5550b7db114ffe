"""Which int8 variant an export writes: each variant's graph as measured (``Candidate``), their speed on the
exporting machine (``measure_speed``), the choice among them (``choose_variant``) and the speed gate
(``check_speedup``): an int8 graph too little faster than fp32 is refused (docs/int8.md, "Faster or refused")."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from capserve.errors import ExportError, Int8SpeedError
from capserve.hardware import CpuInfo
from capserve.runtime.base import Runtime, in_worker_thread

from .gate import GateReport
from .quantize import SearchStep

__all__ = [
    "MIN_SPEEDUP",
    "SPEED_BATCH",
    "SPEED_ROUNDS",
    "Candidate",
    "best_quality",
    "check_speedup",
    "choose_variant",
    "measure_speed",
]

# The least batch-32 speed-up over fp32 an int8 graph must show on the exporting machine to be written: below it
# int8's loss of accuracy buys too little (docs/int8.md, "Faster or refused"), and timings on a busy machine swing
# by a tenth between runs.
MIN_SPEEDUP = 1.2
SPEED_BATCH = 32  # the serving batch: the service's largest adaptive batch (CAPSERVE_MAX_BATCH_SIZE's default)
SPEED_ROUNDS = 7  # interleaved rounds of every graph; the medians are compared


def measure_speed(
    runtimes: Mapping[str, Runtime],
    images: np.ndarray,
    batch: int = SPEED_BATCH,
    rounds: int = SPEED_ROUNDS,
    clock: Callable[[], float] | None = None,
) -> dict[str, float]:
    """Seconds per batch of each runtime on one batch of ``images`` (N, C, H, W; repeated up to ``batch``): after
    one warm-up run each, ``rounds`` rounds that run every runtime once, in turn (the order reversed every other
    round), so that a busy neighbour slows them alike; the median of each runtime's runs. Runs in a worker thread
    (inference in a process's main thread collapses on an oversubscribed CPU). ``clock``: ``time.perf_counter``."""
    if not len(images) or batch < 1 or rounds < 1:
        raise ExportError(f"speed needs images, batch >= 1 and rounds >= 1 (got {len(images)}, {batch}, {rounds})")
    clock = clock or time.perf_counter
    x = np.ascontiguousarray(np.resize(images, (batch, *images.shape[1:])))  # (batch, C, H, W)
    times: dict[str, list[float]] = {name: [] for name in runtimes}

    def work() -> None:
        for runtime in runtimes.values():
            runtime.predict(x)
        order = list(runtimes.items())
        for r in range(rounds):
            for name, runtime in order if r % 2 == 0 else order[::-1]:
                start = clock()
                runtime.predict(x)
                times[name].append(clock() - start)

    in_worker_thread(work, "capserve-int8-speed")
    return {name: statistics.median(t) for name, t in times.items()}


@dataclass(frozen=True)
class Candidate:
    """One variant's int8 graph, as the export measured it on this machine."""

    variant: str
    proto: Any
    kept: list[str]  # weighted nodes left in float
    calibration_agreement: float
    steps: list[SearchStep]
    report: GateReport
    runtime: Runtime
    seconds: float | None = None  # per batch of SPEED_BATCH; None when not timed (TensorRT target)

    @property
    def images_per_s(self) -> float | None:
        return None if self.seconds is None else SPEED_BATCH / max(self.seconds, 1e-12)

    def speedup(self, fp32_seconds: float | None) -> float | None:
        """fp32's time over int8's, on the same batch (None when either was not timed)."""
        return None if self.seconds is None or fp32_seconds is None else fp32_seconds / max(self.seconds, 1e-12)

    def too_slow(self, fp32_seconds: float | None, min_speedup: float) -> bool:
        """Timed, and less than ``min_speedup`` times as fast as fp32."""
        speedup = self.speedup(fp32_seconds)
        return speedup is not None and speedup < min_speedup

    def row(self, fp32_seconds: float | None) -> dict[str, Any]:
        """What ``Int8Summary.variants`` records of it."""
        speedup = self.speedup(fp32_seconds)
        return {
            "variant": self.variant,
            "agreement": self.report.check.agreement,
            "lost": self.report.lost,
            "passed": self.report.passed,
            "kept_float": list(self.kept),
            "images_per_s": self.images_per_s,
            "speedup": speedup,
        }


def best_quality(candidates: Sequence[Candidate]) -> Candidate:
    """The candidate nearest fp32: the highest agreement, then the least accuracy lost (the first of equals)."""
    return max(candidates, key=lambda c: (c.report.check.agreement, -(c.report.lost or 0)))


def choose_variant(
    candidates: list[Candidate],
    fp32: Runtime,
    images: np.ndarray,
    target: str,
    clock: Callable[[], float] | None = None,
) -> tuple[Candidate, list[Candidate], float | None]:
    """The candidate to write. For ONNX Runtime those that pass the gate (else the nearest fp32, for a forced
    export) are timed with ``fp32`` on ``images`` (``measure_speed``) and the fastest passing one is kept; for
    TensorRT (not timed here) the first that passes, else the nearest fp32.

    Returns the one kept, every candidate with its time (None: not timed), and fp32's seconds per batch.
    """
    passing = [c for c in candidates if c.report.passed]
    if target != "onnxruntime":
        return (passing[0] if passing else best_quality(candidates)), candidates, None
    timed = passing or [best_quality(candidates)]
    seconds = measure_speed({"fp32": fp32, **{c.variant: c.runtime for c in timed}}, images, clock=clock)
    candidates = [dataclasses.replace(c, seconds=seconds.get(c.variant)) for c in candidates]
    timed = [c for c in candidates if c.seconds is not None]
    chosen = min(timed, key=lambda c: (not c.report.passed, c.seconds))  # passing first, then the fastest
    return chosen, candidates, seconds.get("fp32")


def check_speedup(
    chosen: Candidate,
    fp32_seconds: float | None,
    min_speedup: float,
    keep_slow: bool,
    names: Sequence[str],
    cpu: CpuInfo,
) -> None:
    """The speed gate: ``Int8SpeedError`` when ``chosen`` is less than ``min_speedup`` times as fast as fp32 on this
    machine, unless ``keep_slow``. ``names``: the variants tried."""
    if chosen.too_slow(fp32_seconds, min_speedup) and not keep_slow:
        tried = f" (the fastest of {', '.join(names)} that passed the gate: {chosen.variant})" if len(names) > 1 else ""
        raise Int8SpeedError(
            f"not written: int8 runs at {chosen.speedup(fp32_seconds):.2f}x fp32 at batch {SPEED_BATCH} on this CPU "
            f"({cpu.describe()}){tried}, below the {min_speedup:g}x it must gain to be worth its rounding; serve the "
            "fp32 graph, or pass --keep-slow to write it anyway"
        )
