"""The runtimes a server can serve a model folder with on this machine (``runtime_candidates``), and the one a
server starts with when nothing else chose it: the fastest of them, measured here (``fastest_runtime``).

A server whose runtime (``RUNTIME_CHOICES``: backend, precision, graph file) no ``CAPSERVE_*`` setting and no tuned
file chose serves the fastest runtime that applies to its single-label model on this machine:

1. the candidates are ``capserve tune``'s first step on the server's device: ONNX Runtime fp32 (the default), each
   INT8 graph in the model folder that passes its start-up re-check here (``int8_graphs``: one log line for one that
   does not), torch bf16 where the CPU does bf16 natively; on a GPU, ONNX Runtime's CUDA provider and a TensorRT
   engine in the folder. With one candidate (a CPU without native bf16, a folder without an INT8 graph) nothing
   is measured: the server starts as it always did;
2. each is opened as the server opens it (``open_model``: bf16 that disagrees with fp32 falls back, and is dropped)
   and timed on batches of the server's largest adaptive batch and on one image, with the server's threads, in
   interleaved rounds so that other load falls on all alike, for at most ``BUDGET_S`` seconds after opening them
   (medians);
3. another runtime replaces the default only when it is ``MIN_SPEEDUP`` times as fast on batches (a near-tie is the
   noise of a shared machine, and every other runtime costs the HTTP path more per request than ONNX Runtime's
   fp32 session) and at least ``LONE_MIN_SHARE`` as fast on one image (a lone request keeps its latency);
4. the figures are kept per model files, CPU, device, threads and versions (``CACHE_FILE`` among the measurements
   kept for this machine, ``capserve.files.cache_file``): a restart reads them and measures nothing.

The ``bentoml serve`` process measures, before it starts its workers, and hands the choice to them in the
environment (``CHOSEN_VARIABLE``): a server with several workers measures once. ``GET /model`` names the measurement
as the source of each runtime choice. ``CAPSERVE_MEASURE_RUNTIMES=0`` keeps the default without measuring. BentoML
1.4.40 takes a service's runtime as given: nothing there measures one.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from capserve.errors import ConfigurationError
from capserve.files import cache_file, keep_cached, read_cached
from capserve.hardware import CpuInfo, cpu_info
from capserve.hashing import file_sha256, sha256_bytes
from capserve.pipeline.models import ARTIFACTS, EXPLAIN_ARTIFACT, OpenOptions, open_model, resolve_model
from capserve.runtime.precision import native_bf16, sample_images
from capserve.serving.settings import Settings
from capserve.serving.tuned import RUNTIME_CHOICES
from capserve.serving.workers import assign, visible_gpus, worker_count

__all__ = [
    "BUDGET_S",
    "CACHE_FILE",
    "CHOSEN_VARIABLE",
    "LONE_MIN_SHARE",
    "MIN_SPEEDUP",
    "RUNTIME_ORDER",
    "Candidate",
    "Speed",
    "choose_runtime",
    "fastest_runtime",
    "int8_graphs",
    "measure_speeds",
    "runtime_candidates",
    "workers_environment",
]

log = logging.getLogger(__name__)

MIN_SPEEDUP = 1.1  # another runtime replaces ONNX Runtime fp32 only when this many times as fast on batches


LONE_MIN_SHARE = 0.9  # ... and at least this share of its speed on one image: lone requests keep their latency


BUDGET_S = 30.0  # seconds of timing at most, after the candidates are open (each gets at least one round)


ROUNDS = 5  # interleaved timed batches of each candidate, after one warm-up batch each


CACHE_FILE = "serving-runtimes.json"


CHOSEN_VARIABLE = "CAPSERVE_MEASURED_RUNTIME"  # the ``bentoml serve`` process → its workers: the choice, as JSON


RUNTIME_ORDER = {"onnxruntime fp32": 0, "onnxruntime int8": 1, "torch bf16": 2, "onnxruntime cuda": 3, "tensorrt": 4}


@dataclass(frozen=True)
class Candidate:
    """One server configuration: its runtime (backend, precision, the graph file for onnxruntime, device) and its
    workers, intra-op threads per worker and largest adaptive batch."""

    runtime: str = "onnxruntime fp32"  # a key of RUNTIME_ORDER
    backend: str = "onnxruntime"
    precision: str = "auto"
    artifact: str | None = None  # onnxruntime's graph in the model folder; None: model.onnx
    device: str = "cpu"
    workers: int = 1
    threads: int = 1
    max_batch_size: int = Settings.max_batch_size

    def environment(self) -> dict[str, str]:
        """The ``CAPSERVE_*`` variables that make a server this candidate (its graph: ``settings``'s artifact)."""
        return {
            "CAPSERVE_BACKEND": self.backend,
            "CAPSERVE_PRECISION": self.precision,
            "CAPSERVE_DEVICE": self.device,
            "CAPSERVE_WORKERS": str(self.workers),
            "CAPSERVE_THREADS": str(self.threads),
            "CAPSERVE_MAX_BATCH_SIZE": str(self.max_batch_size),
        }

    def settings(self) -> dict[str, object]:
        """This candidate as a tuned file's settings (capserve.serving.tuned.CHOICES)."""
        chosen: dict[str, object] = {
            "backend": self.backend,
            "precision": self.precision,
            "workers": self.workers,
            "threads": self.threads,
            "max_batch_size": self.max_batch_size,
        }
        return {**chosen, "artifact": self.artifact} if self.artifact else chosen

    def label(self) -> str:
        threads = "thread" if self.threads == 1 else "threads"
        workers = "worker" if self.workers == 1 else "workers"
        return (
            f"{self.runtime}{f' ({self.artifact})' if self.artifact else ''}, {self.workers} {workers} x "
            f"{self.threads} {threads}, batch {self.max_batch_size}"
        )

    def simplicity(self, cores: int) -> tuple[int, ...]:
        """Smaller is simpler: fewer workers, the default runtime, the default batch, each worker with its share
        of the cores (the default threads), then fewer threads."""
        return (
            self.workers,
            RUNTIME_ORDER.get(self.runtime, len(RUNTIME_ORDER)),
            int(self.max_batch_size != Settings.max_batch_size),
            int(self.threads != max(1, cores // self.workers)),
            self.threads,
        )


def int8_graphs(folder: Path) -> list[str]:
    """The INT8 graphs in a model folder: ``.onnx`` files (not the fp32 ``model.onnx`` or an explanation graph)
    that ONNX Runtime loads with precision int8 (as ``capserve export onnx --int8`` writes them). Nothing is
    quantized here."""
    from capserve.runtime import load_runtime

    found = []
    for path in sorted(folder.glob("*.onnx")):
        if path.name in (ARTIFACTS["onnxruntime"], EXPLAIN_ARTIFACT) or path.name.endswith("-explain.onnx"):
            continue
        try:
            runtime = load_runtime(path, "onnxruntime", "cpu", threads=1)
        except Exception as e:  # not a graph capserve serves here (the runtime says why): not a candidate
            log.warning("not measuring %s: %s", path, e)
            continue
        if runtime.precision == "int8":
            found.append(path.name)
    return found


def runtime_candidates(folder: Path, cores: int, gpus: int) -> list[Candidate]:
    """Step 1's candidates that apply to ``folder`` on this machine, the default first."""
    share = dict(workers=1, threads=max(1, cores))
    out = []
    if (folder / ARTIFACTS["onnxruntime"]).is_file():
        out.append(Candidate(**share))
        out += [Candidate("onnxruntime int8", artifact=name, **share) for name in int8_graphs(folder)]
    if native_bf16().native:
        out.append(Candidate("torch bf16", backend="torch", precision="bf16", **share))
    if gpus:
        import onnxruntime

        if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
            out.append(Candidate("onnxruntime cuda", device="cuda", workers=gpus, threads=1))
        if (folder / ARTIFACTS["tensorrt"]).is_file():
            out.append(Candidate("tensorrt", backend="tensorrt", device="cuda", workers=gpus, threads=1))
    return out


# ------------------------------------------------------------------------------------------ the start-up choice


@dataclass(frozen=True)
class Speed:
    """A runtime's images/s here: on batches of the server's largest adaptive batch, and on one image (a lone
    request's)."""

    batch: float
    one: float

    def __str__(self) -> str:
        return f"{self.batch:.1f} img/s, {self.one:.1f} one at a time"


# a candidate → its speed, or why it is not served here (it could not be opened, or bf16 fell back to fp32)
Speeds = dict[Candidate, "Speed | str"]


Measure = Callable[[Path, Sequence[Candidate], int, int], Speeds]  # (folder, candidates, threads, batch) → speeds


def measure_speeds(
    folder: Path, candidates: Sequence[Candidate], threads: int, batch: int, clock: Callable[[], float] = time.monotonic
) -> Speeds:
    """Each candidate opened as the server opens it and timed on ``batch`` images and on one, with ``threads``
    intra-op threads: a warm-up each, then up to ``ROUNDS`` interleaved rounds while ``BUDGET_S`` lasts; medians."""
    speeds: Speeds = {}
    opened = {}
    for candidate in candidates:
        options = OpenOptions(
            backend=candidate.backend,
            device=candidate.device,
            precision=candidate.precision,
            artifact=candidate.artifact,
            threads=threads,
            max_batch_size=1,  # the session adaptive batches run on: its threads sleep between runs
            unfamiliar=False,  # speed only
        )
        try:
            runtime, _, _ = open_model(str(folder), options, explain=False)
        except ConfigurationError as e:
            speeds[candidate] = str(e)
            continue
        if candidate.precision == "bf16" and runtime.precision != "bf16":
            speeds[candidate] = runtime.precision_reason
            continue
        opened[candidate] = runtime
    if not opened:
        return speeds
    images = sample_images(next(iter(opened.values())).metadata, batch)  # (batch, C, H, W)
    seconds: dict[Candidate, tuple[list[float], list[float]]] = {candidate: ([], []) for candidate in opened}
    for runtime in opened.values():
        runtime.predict(images)  # warm-up: first-run allocations and kernel choices
        runtime.predict(images[:1])
    deadline = clock() + BUDGET_S
    for round_ in range(ROUNDS):
        if round_ and clock() > deadline:
            break
        for candidate, runtime in opened.items():
            for times, x in zip(seconds[candidate], (images, images[:1]), strict=True):
                start = time.perf_counter()
                runtime.predict(x)
                times.append(time.perf_counter() - start)
    for candidate, (on_batches, on_one) in seconds.items():
        speeds[candidate] = Speed(batch / statistics.median(on_batches), 1 / statistics.median(on_one))
    opened.clear()
    gc.collect()  # the measured sessions' memory, before the workers start
    return speeds


def choose_runtime(speeds: Mapping[Candidate, Speed | str], default: Candidate) -> Candidate:
    """The candidate fastest on batches among those at least ``LONE_MIN_SHARE`` as fast as ``default`` on one
    image, where it is at least ``MIN_SPEEDUP`` times as fast as ``default`` on batches; else ``default`` (also when
    ``default`` was not measured: nothing to compare with)."""
    measured = {c: s for c, s in speeds.items() if isinstance(s, Speed)}
    if default not in measured:
        return default
    base = measured[default]
    fair = [c for c, s in measured.items() if s.one >= LONE_MIN_SHARE * base.one]
    best = max(fair, key=lambda c: measured[c].batch)
    return best if measured[best].batch >= MIN_SPEEDUP * base.batch else default


def fastest_runtime(
    settings: Settings,
    env: Mapping[str, str],
    cpu: CpuInfo | None = None,
    gpus: int | None = None,
    measure: Measure | None = None,
) -> Settings:
    """``settings`` serving the fastest runtime here when nothing chose one (module docstring); ``sources`` says it
    was measured. A worker takes its server process's choice from ``env`` (``CHOSEN_VARIABLE``). ``measure``
    replaces ``measure_speeds`` (tests)."""
    if not settings.measure_runtimes or any(settings.sources.get(n, "default") != "default" for n in RUNTIME_CHOICES):
        return settings
    if env.get(CHOSEN_VARIABLE):
        return _chosen_by_server(settings, env[CHOSEN_VARIABLE])
    folder = resolve_model(settings.model).path
    if not folder.is_dir():
        return settings  # a graph file given as the model: that is the runtime
    cpu = cpu or cpu_info()
    threads = assign(settings, 0, worker_count(settings)).threads  # each worker's, as it will run
    on_gpu = settings.device != "cpu"
    if gpus is None:
        gpus = visible_gpus() if on_gpu else 0
    candidates = [
        dataclasses.replace(c, device=settings.device, threads=threads)
        for c in runtime_candidates(folder, threads, gpus)
        if (c.device != "cpu") == on_gpu
    ]
    default = Candidate(device=settings.device, threads=threads)
    if len(candidates) < 2 or candidates[0] != default:
        return settings  # nothing to choose between (or no default graph: the server says what is missing)
    speeds, kept = _measured(folder, candidates, cpu, settings, measure or measure_speeds)
    chosen = choose_runtime(speeds, default)
    figures = "; ".join(
        f"{c.runtime}{f' ({c.artifact})' if c.artifact else ''} "
        + (str(s) if isinstance(s, Speed) else f"not served here: {s}")
        for c, s in speeds.items()
    )
    when = "at an earlier start" if kept else "at start-up"
    threads_text = f"{threads} thread{'' if threads == 1 else 's'}"
    source = f"measured {when} on {cpu.describe()}, {threads_text}, batch {settings.max_batch_size}: {figures}"
    log.info(
        "runtime %s (the default unless another is %gx as fast on batches and %g as fast on one image), %s",
        chosen.runtime,
        MIN_SPEEDUP,
        LONE_MIN_SHARE,
        source,
    )
    return _with_runtime(settings, chosen, source)


def workers_environment(settings: Settings) -> dict[str, str]:
    """What the server process hands its workers so that they serve its measured choice without measuring:
    ``{CHOSEN_VARIABLE: JSON}``, or {} when the runtime was not measured."""
    source = settings.sources.get("backend", "")
    if not source.startswith("measured"):
        return {}
    runtime = {"backend": settings.backend, "precision": settings.precision, "artifact": settings.artifact}
    return {CHOSEN_VARIABLE: json.dumps({"runtime": runtime, "source": source})}


def _chosen_by_server(settings: Settings, text: str) -> Settings:
    try:
        data = json.loads(text)
        runtime, source = dict(data["runtime"]), str(data["source"])
        chosen = Candidate(backend=str(runtime["backend"]), precision=str(runtime["precision"]))
        chosen = dataclasses.replace(chosen, artifact=runtime["artifact"] and str(runtime["artifact"]))
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigurationError(f"{CHOSEN_VARIABLE} is set by capserve's server process only: {e}") from None
    return _with_runtime(settings, chosen, source)


def _with_runtime(settings: Settings, chosen: Candidate, source: str) -> Settings:
    sources = {**settings.sources, **dict.fromkeys(RUNTIME_CHOICES, source)}
    runtime = dict(backend=chosen.backend, precision=chosen.precision, artifact=chosen.artifact)
    return dataclasses.replace(settings, **runtime, sources=sources)


def _measured(
    folder: Path, candidates: list[Candidate], cpu: CpuInfo, settings: Settings, measure: Measure
) -> tuple[Speeds, bool]:
    """The candidates' speeds, from the figures kept for this model, machine and threads, or measured (and kept);
    and whether they were kept from an earlier start."""
    from capserve import __version__

    files = sorted(
        {ARTIFACTS["onnxruntime"], "config.json", "model.safetensors"} | {c.artifact or "" for c in candidates} - {""}
    )
    what = {
        "files": {name: file_sha256(folder / name) for name in files if (folder / name).is_file()},
        "cpu": cpu.describe(),
        "device": settings.device,
        "threads": candidates[0].threads,
        "batch": settings.max_batch_size,
        "versions": _versions(__version__),
        "candidates": [c.label() for c in candidates],
    }
    key = sha256_bytes(json.dumps(what, sort_keys=True).encode())
    path = cache_file(CACHE_FILE)
    kept = read_cached(path)
    try:
        return dict(zip(candidates, map(_speed, kept[key]["speeds"]), strict=True)), True
    except (KeyError, TypeError, ValueError):  # not measured here yet (or a damaged entry): measure
        pass
    log.info("measuring %d runtimes for %s on this machine (once: kept in %s)", len(candidates), folder, path)
    speeds = measure(folder, candidates, candidates[0].threads, settings.max_batch_size)
    kept[key] = {
        "speeds": [_kept(speeds.get(c, "not measured")) for c in candidates],
        "cpu": what["cpu"],
        "model": str(folder),
    }
    keep_cached(path, kept, "the measured runtime speeds")
    return speeds, False


def _kept(speed: Speed | str) -> list[float] | str:
    return [speed.batch, speed.one] if isinstance(speed, Speed) else speed


def _speed(kept: object) -> Speed | str:
    """A speed as ``_kept`` wrote it (``ValueError`` for anything else: measured again)."""
    if isinstance(kept, str):
        return kept
    if isinstance(kept, list) and len(kept) == 2 and all(isinstance(v, float) and v > 0 for v in kept):
        return Speed(*kept)
    raise ValueError(f"not a kept speed: {kept!r}")


def _versions(capserve_version: str) -> dict[str, str]:
    """The libraries whose kernels the speeds depend on."""
    import onnxruntime
    import torch

    return {"capserve": capserve_version, "onnxruntime": onnxruntime.__version__, "torch": torch.__version__}
