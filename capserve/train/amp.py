"""How a training step computes: in the arithmetic that is fastest on the machine that trains (``fastest_amp``), and
on a CPU with kernels whose sums do not follow the threads' timing (``deterministic_kernels``).

``--amp auto``, the default, measures a few training steps of the run's own model at its batch in fp32, under bf16
autocast, and under bf16 autocast with channels-last memory, on this device, and trains in the fastest: bf16 only
where it is at least ``BF16_MIN_SPEEDUP`` faster than fp32, channels-last only where it is at least
``CHANNELS_LAST_MIN_SPEEDUP`` faster than bf16 without it (a near-tie is the noise of a shared machine, and fp32
the simpler). Where bf16 cannot be faster, nothing is measured and the run trains in fp32: a CPU without native bf16
arithmetic (``capserve.runtime.precision.native_bf16``: there autocast emulates it), a GPU without bf16. A given
``--amp`` (``off`` for fp32) or ``--channels-last`` wins, and a resumed run keeps what it recorded.

The measurement interleaves short rounds of each candidate (fp32, bf16, bf16 + channels-last, fp32, ...) so that
another process's load falls on all alike, and compares medians; a candidate whose warm-up step takes ``HOPELESS``
times the fastest's cannot win and is measured no further. docs/training.md ("Precision") is the manual,
docs/benchmarks/training.md ("Training in bf16", "Deterministic kernels") has the figures.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.utils.deterministic
from torch import nn

from capserve.configs import ModelConfig
from capserve.files import cache_file, keep_cached, read_cached
from capserve.hardware import cpu_info
from capserve.model.factory import build_model
from capserve.runtime.precision import native_bf16
from capserve.train.config import TrainConfig
from capserve.train.distributed import Dist

__all__ = [
    "BF16_MIN_SPEEDUP",
    "CANDIDATES",
    "CHANNELS_LAST_MIN_SPEEDUP",
    "AmpCandidate",
    "bf16_support",
    "cache_path",
    "choose",
    "deterministic_kernels",
    "fastest_amp",
    "measured_seconds",
    "run_precision",
    "step_seconds",
]

BF16_MIN_SPEEDUP = 1.1  # bf16 over fp32: below it, fp32 (the same answers, no rounding)
CHANNELS_LAST_MIN_SPEEDUP = 1.02  # channels-last bf16 over plain bf16
ROUNDS = 3  # interleaved rounds of every candidate
STEPS = 2  # timed steps per candidate and round, after one warm-up step per round
HOPELESS = 3.0  # a candidate whose warm-up step takes this many times the fastest one's is measured no further
CACHE_FILE = "train-precision.json"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AmpCandidate:
    """One way to run a training step: the autocast dtype (``TrainConfig.amp``) and the memory format."""

    amp: str  # "off" (fp32) or "bf16"
    channels_last: bool

    def label(self) -> str:
        name = "fp32" if self.amp == "off" else self.amp
        return f"{name} + channels-last" if self.channels_last else name


FP32 = AmpCandidate("off", False)
BF16 = AmpCandidate("bf16", False)
BF16_CHANNELS_LAST = AmpCandidate("bf16", True)
CANDIDATES = (FP32, BF16, BF16_CHANNELS_LAST)

# a training step's seconds for each candidate: (model config, batch size, device, candidates) -> {candidate: s}
Measure = Callable[[ModelConfig, int, torch.device, list[AmpCandidate]], dict[AmpCandidate, float]]


@contextmanager
def deterministic_kernels(device: torch.device) -> Iterator[None]:
    """On a CPU, kernels whose sums never follow the threads' timing (``torch.use_deterministic_algorithms``, which
    also makes oneDNN's convolution gradients reduce in a fixed order): a parallel kernel that adds with atomics (an
    indexed tensor's gradient) sums in whatever order busy threads reach it, so two seeded runs, or a resumed run and
    the one never stopped, would part by rounding on a loaded machine. The same seed and thread count then give the
    same weights. New tensors are not filled first (``fill_uninitialized_memory``, which the setting turns on to
    expose reads of memory never written: every tensor the training code reads it has written). The previous
    settings are restored afterwards. On a GPU the run keeps cuDNN's fastest kernels (``capserve.train.loop.set_up``),
    whose choice and sums may vary (docs/training.md)."""
    if device.type != "cpu":
        yield
        return
    settings = torch.utils.deterministic
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        settings.fill_uninitialized_memory,
    )
    torch.use_deterministic_algorithms(True)
    settings.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        settings.fill_uninitialized_memory = before[2]


def bf16_support(device: torch.device) -> tuple[bool, str]:
    """Whether bf16 autocast can be faster than fp32 on ``device``, and why (for the log)."""
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return True, f"{torch.cuda.get_device_name(device)} computes in bf16"
        return False, f"{torch.cuda.get_device_name(device)} has no bf16 arithmetic"
    if device.type != "cpu":
        return False, f"bf16 is measured on CPUs and CUDA GPUs, not {device.type}"
    support = native_bf16()
    return support.native, support.reason


def step_seconds(
    config: ModelConfig, batch_size: int, device: torch.device, candidates: list[AmpCandidate]
) -> dict[AmpCandidate, float]:
    """The median seconds of a training step (forward, loss, backward) of a model built from ``config`` on a random
    batch of ``batch_size``, for each candidate, over ``ROUNDS`` interleaved rounds of ``STEPS`` steps. The model is
    a copy built here: the run's own weights, and its random number streams, are not touched."""
    generator = torch.Generator().manual_seed(0)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):  # the run's streams untouched
        model = build_model(config).to(device).train()
    shape = (batch_size, config.in_channels, config.image_size, config.image_size)
    x = torch.randn(shape, generator=generator).to(device)
    models = {
        c: copy.deepcopy(model).to(memory_format=torch.channels_last) if c.channels_last else model for c in candidates
    }
    inputs = {c: x.contiguous(memory_format=torch.channels_last) if c.channels_last else x for c in candidates}
    times: dict[AmpCandidate, list[float]] = {c: [] for c in candidates}
    measuring = list(candidates)
    for _ in range(ROUNDS):
        warm: dict[AmpCandidate, float] = {}
        for c in list(measuring):
            warm[c] = _seconds(models[c], inputs[c], c, device, 1)  # the first step of a round allocates
            if warm[c] > HOPELESS * min(warm.values()):  # emulated bf16, say: it cannot win, so no more of it
                times[c].append(warm[c])
                measuring.remove(c)
                continue
            times[c].append(_seconds(models[c], inputs[c], c, device, STEPS) / STEPS)
    return {c: statistics.median(t) for c, t in times.items()}


def _seconds(model: nn.Module, x: torch.Tensor, candidate: AmpCandidate, device: torch.device, steps: int) -> float:
    started = time.perf_counter()
    for _ in range(steps):
        _step(model, x, candidate, device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def _step(model: nn.Module, x: torch.Tensor, candidate: AmpCandidate, device: torch.device) -> None:
    dtype = torch.bfloat16 if candidate.amp == "bf16" else None
    with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
        logits = model(x)
    logits.float().logsumexp(dim=1).mean().backward()  # a loss's cost: the backward pass through every layer
    model.zero_grad(set_to_none=True)


def choose(seconds: dict[AmpCandidate, float]) -> AmpCandidate:
    """The fastest of the measured candidates (one fp32, bf16 with one memory format or both), bf16 only where it
    beats fp32 by ``BF16_MIN_SPEEDUP``, and channels-last only where it beats plain bf16 by
    ``CHANNELS_LAST_MIN_SPEEDUP``."""
    fp32 = next(c for c in seconds if c.amp == "off")
    best = fp32
    for c in sorted((c for c in seconds if c.amp == "bf16"), key=lambda c: c.channels_last):  # plain bf16 first
        faster = seconds[fp32] >= BF16_MIN_SPEEDUP * seconds[c]
        if faster and (best == fp32 or seconds[best] >= CHANNELS_LAST_MIN_SPEEDUP * seconds[c]):
            best = c
    return best


def fastest_amp(
    amp: str,
    channels_last: bool | None,
    config: ModelConfig,
    batch_size: int,
    device: torch.device,
    measure: Measure | None = None,
) -> tuple[AmpCandidate, str]:
    """``--amp`` and ``--channels-last`` resolved, and why: as given, or (``--amp auto``) the fastest measured here
    (``channels_last`` None: both memory formats measured under bf16; given: that one alone)."""
    if amp != "auto":
        return AmpCandidate(amp, bool(channels_last)), "given"
    can, why = bf16_support(device)
    if not can:
        return AmpCandidate("off", bool(channels_last)), f"no bf16 measured: {why}"
    if channels_last is None:
        candidates = list(CANDIDATES)
    else:
        candidates = [AmpCandidate("off", channels_last), AmpCandidate("bf16", channels_last)]
    seconds, cached = measured_seconds(config, batch_size, device, candidates, measure or step_seconds)
    figures = ", ".join(f"{c.label()} {1000 * s:.0f} ms" for c, s in seconds.items())
    again = f"; measured by an earlier run on this machine ({cached})" if cached else ""
    return choose(seconds), f"measured a training step at batch {batch_size} ({why}): {figures}{again}"


def cache_path() -> Path:
    """Where measured step times are kept (``capserve.files.cache_file``)."""
    return cache_file(CACHE_FILE)


def measured_seconds(
    config: ModelConfig, batch_size: int, device: torch.device, candidates: list[AmpCandidate], measure: Measure
) -> tuple[dict[AmpCandidate, float], Path | None]:
    """``measure``'s step times, or those an earlier run kept for the same machine (CPU, device, torch, threads),
    model shape, batch and candidates, so that every run there makes the same choice (a seeded run repeats itself);
    and the cache file when the times came from it."""
    what = {k: v for k, v in dataclasses.asdict(config).items() if k not in ("name", "labels", "mean", "std", "extra")}
    what.update(
        classes=len(config.labels),
        cpu=cpu_info().describe(),
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        torch=torch.__version__,
        threads=torch.get_num_threads(),
        batch=batch_size,
        candidates=[c.label() for c in candidates],
    )
    key = hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()
    path = cache_path()
    kept = read_cached(path)
    try:
        return {c: float(kept[key]["seconds"][c.label()]) for c in candidates}, path
    except (KeyError, TypeError, ValueError):  # not measured here yet (or a damaged entry): measure
        pass
    seconds = measure(config, batch_size, device, candidates)
    kept[key] = {"seconds": {c.label(): s for c, s in seconds.items()}, "cpu": what["cpu"], "batch": batch_size}
    keep_cached(path, kept, "the measured step times")
    return seconds, None


def run_precision(cfg: TrainConfig, config: ModelConfig, d: Dist, device: torch.device) -> tuple[AmpCandidate, str]:
    """``fastest_amp`` for the run ``cfg`` (its batch per process); under DDP the first process measures and every
    process trains as it chose."""
    chosen: list[object] = [None, ""]
    if d.main:
        chosen = list(fastest_amp(cfg.amp, cfg.channels_last, config, cfg.batch_size // d.world, device))
    if d.enabled:
        dist.broadcast_object_list(chosen, src=0)
    return chosen[0], chosen[1]  # type: ignore[return-value]
