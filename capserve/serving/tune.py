"""``capserve tune MODEL [--budget S] [--out FILE]``: the serving choices measured on the machine that will serve,
written to the tuned file (capserve.serving.tuned).

Each candidate is the real server (``bentoml serve`` of capserve's service, as ``capserve serve`` starts it) under
``/classify`` load from ``capserve.serving.loadtest``: 32 concurrent keep-alive clients (its score, requests/s),
then one client at a time (p50, for the table). The candidates come in three steps, each from the best of the one
before, so that the likely best are measured first and a spent budget leaves the most useful ones measured:

1. the runtime on one worker with every core: ONNX Runtime fp32 (the default), an INT8 graph found in the model
   folder, torch bf16 where the CPU does bf16 natively, and ONNX Runtime's CUDA provider and a TensorRT engine
   where a GPU is visible;
2. workers x intra-op threads (1 .. the cores) with that runtime (on GPUs: one worker per GPU, as ``auto``);
3. adaptive batching's largest batch (``CAPSERVE_MAX_BATCH_SIZE``) around the default of 32.

``CAPSERVE_MAX_LATENCY_MS`` is not searched: it is when adaptive batching sheds a request with a 503, not a
throughput knob, and every candidate keeps the default. ``choose`` picks the best requests/s among the candidates
without errors, and among those within ``TIE`` of it the simplest (``Candidate.simplicity``): a near-tie is noise
on a shared machine, and the simpler configuration is the one a reader can reason about.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from capserve.errors import UsageError
from capserve.hardware import CpuInfo, cpu_info
from capserve.pipeline.models import resolve_model
from capserve.serving.loadtest import load, random_png, running_server
from capserve.serving.runtimes import Candidate, runtime_candidates
from capserve.serving.tuned import CORE_CHOICES, RUNTIME_CHOICES, TUNED_FILE, TUNED_VARIABLE, Tuned, write_tuned
from capserve.serving.workers import visible_gpus

__all__ = [
    "BATCH_SIZES",
    "CONCURRENCY",
    "DEFAULT_BUDGET_S",
    "TIE",
    "Measurement",
    "Tuning",
    "add_arguments",
    "choose",
    "measure_server",
    "run",
    "table_of",
    "tune",
]

log = logging.getLogger(__name__)

CONCURRENCY = 32  # clients of the measurement that scores a candidate


TIE = 0.02  # requests/s this close to the best count as a tie, broken toward the simpler candidate


DEFAULT_BUDGET_S = 120.0  # --budget: about two minutes


BATCH_SIZES = (16, 64)  # CAPSERVE_MAX_BATCH_SIZE tried beside the default (Settings.max_batch_size)


@dataclass(frozen=True)
class Measurement:
    """A candidate's figures: requests/s at ``CONCURRENCY`` clients (its score), p50 latency there and at one
    client, answers other than 200, and the seconds the whole measurement took (start-up included)."""

    candidate: Candidate
    requests_per_s: float
    p50_ms: float
    p50_one_ms: float
    errors: int
    seconds: float
    failure: str = ""  # why the server did not start or answer; the candidate then counts as unmeasured

    @property
    def valid(self) -> bool:
        return not self.failure and self.errors == 0 and self.requests_per_s > 0

    def row(self) -> dict[str, object]:
        """The tuned file's record of this measurement."""
        return {
            "candidate": self.candidate.label(),
            "settings": self.candidate.settings(),
            "requests_per_s": round(self.requests_per_s, 2),
            "p50_ms": round(self.p50_ms, 2),
            "p50_one_client_ms": round(self.p50_one_ms, 2),
            "errors": self.errors,
            **({"failure": self.failure} if self.failure else {}),
        }


def choose(measurements: Sequence[Measurement], cores: int, tie: float = TIE) -> Measurement:
    """The best measurement: the most requests/s among those without errors, the simplest among those within
    ``tie`` of it. ``ValueError`` when none is valid."""
    valid = [m for m in measurements if m.valid]
    if not valid:
        raise ValueError("no candidate was measured without errors")
    best = max(m.requests_per_s for m in valid)
    near = [m for m in valid if m.requests_per_s >= best * (1 - tie)]
    return min(near, key=lambda m: (m.candidate.simplicity(cores), -m.requests_per_s))


def worker_candidates(best: Candidate, cores: int) -> list[Candidate]:
    """Step 2: workers x threads around ``best`` (each worker's share of the cores first, then all cores per
    worker, then one thread); on GPUs none (one worker per GPU)."""
    if best.device != "cpu":
        return []
    out: list[Candidate] = []
    for workers in range(1, min(cores, 4) + 1):
        for threads in dict.fromkeys((max(1, cores // workers), cores, 1)):
            candidate = dataclasses.replace(best, workers=workers, threads=threads)
            if candidate != best and candidate not in out:
                out.append(candidate)
    return out


def batch_candidates(best: Candidate) -> list[Candidate]:
    """Step 3: adaptive batching's largest batch around the default."""
    return [dataclasses.replace(best, max_batch_size=size) for size in BATCH_SIZES if size != best.max_batch_size]


@dataclass
class Tuning:
    """What ``tune`` did: every measurement in order, the chosen one, whether the budget cut it short, and the
    candidates it left unmeasured."""

    measurements: list[Measurement]
    chosen: Measurement
    cpu: CpuInfo
    budget_s: float
    skipped: list[Candidate]

    def compared(self) -> tuple[tuple[str, ...], ...]:
        """The groups of choices (``RUNTIME_CHOICES``, ``CORE_CHOICES``, the batch) that tune measured more than one
        way without errors: only those are chosen by measurement; the others stay the server's defaults."""
        valid = [m.candidate for m in self.measurements if m.valid]
        groups = {
            RUNTIME_CHOICES: lambda c: (c.runtime, c.artifact, c.device),
            CORE_CHOICES: lambda c: (c.workers, c.threads),
            ("max_batch_size",): lambda c: c.max_batch_size,
        }
        return tuple(group for group, key in groups.items() if len({key(c) for c in valid}) > 1)

    def record(self, device: str) -> Tuned:
        """The tuned file for this tuning: the chosen candidate's settings in the groups it was compared in."""
        from capserve import __version__

        compared = {name for group in self.compared() for name in group}
        return Tuned(
            cpu={**self.cpu.to_dict(), "cores": self.cpu.cores},
            device=device,
            settings={k: v for k, v in self.chosen.candidate.settings().items() if k in compared},
            measured=[m.row() for m in self.measurements],
            budget_s=self.budget_s,
            capserve_version=__version__,
        )


Measure = Callable[[Candidate, float], Measurement]  # (candidate, seconds of load) → its measurement


def tune(
    folder: Path,
    budget_s: float,
    measure: Measure,
    cpu: CpuInfo | None = None,
    gpus: int = 0,
    clock: Callable[[], float] = time.monotonic,
    progress: Callable[[Candidate, int, float], None] | None = None,
    candidates: Sequence[Candidate] | None = None,
) -> Tuning:
    """Measure the candidates in steps (module docstring) within ``budget_s`` seconds of ``clock``, and choose.

    ``measure(candidate, seconds)`` runs one measurement; a candidate starts only when the longest measurement so
    far still fits in what is left of the budget (the first always runs: there must be a choice). ``progress`` is
    told each candidate as it starts, its number, and the seconds spent so far. ``candidates`` replaces step 1's
    (tests; the default is ``runtime_candidates``)."""
    cpu = cpu or cpu_info()
    cores = cpu.cores
    start = clock()
    measured: list[Measurement] = []
    skipped: list[Candidate] = []
    load_s = load_seconds(budget_s)

    def run(step: list[Candidate]) -> None:
        for candidate in step:
            spent = clock() - start
            longest = max((m.seconds for m in measured), default=0.0)
            if measured and spent + longest > budget_s:
                skipped.append(candidate)
                continue
            if progress:
                progress(candidate, len(measured) + 1, spent)
            result = measure(candidate, load_s)
            if result.failure:
                log.warning("%s: %s", candidate.label(), result.failure)
            measured.append(result)

    first = list(candidates) if candidates is not None else runtime_candidates(folder, cores, gpus)
    if not first:
        raise UsageError(f"{folder} has nothing capserve can serve here: export model.onnx first")
    run(first)
    run(worker_candidates(_best(measured, cores, first[0]), cores))
    run(batch_candidates(_best(measured, cores, first[0])))
    if not any(m.valid for m in measured):
        why = next((m.failure for m in measured if m.failure), "every answer had errors")
        raise UsageError(f"no candidate served /classify without errors, nothing written: {why}")
    return Tuning(measured, choose(measured, cores), cpu, budget_s, skipped)


def _best(measured: list[Measurement], cores: int, default: Candidate) -> Candidate:
    try:
        return choose(measured, cores).candidate
    except ValueError:
        return default


def load_seconds(budget_s: float) -> float:
    """Seconds of load at 32 clients per candidate: enough for the batches to settle, short enough that a default
    budget measures the three steps (start-up takes longer than this on a small machine)."""
    return float(np.clip(budget_s / 30, 1.0, 8.0))


def server_environment(folder: Path, candidate: Candidate, home: Path) -> dict[str, str]:
    """The environment of ``candidate``'s server: ``folder`` alone (or its graph ``candidate.artifact``), no tuned
    file, no web page, tune's own BentoML home."""
    env = {
        **os.environ,
        **candidate.environment(),
        "CAPSERVE_MODEL": str(folder / candidate.artifact if candidate.artifact else folder),
        "CAPSERVE_MULTILABEL_MODEL": "none",
        TUNED_VARIABLE: "none",
        "CAPSERVE_UI": "0",
        "BENTOML_HOME": str(home),
        "BENTOML_DO_NOT_TRACK": "True",
    }
    return env


def measure_server(folder: Path, image_size: int, home: Path) -> Measure:
    """The real ``Measure``: ``running_server`` under ``load``: a warm-up, ``seconds`` at ``CONCURRENCY`` clients
    (requests/s, p50), then a third of that at one client (p50)."""
    bodies = [random_png(image_size, seed) for seed in range(16)]

    def measure(candidate: Candidate, seconds: float) -> Measurement:
        started = time.monotonic()
        try:
            with running_server(server_environment(folder, candidate, home), home) as url:
                asyncio.run(load(url, bodies, 4 * CONCURRENCY, CONCURRENCY, seconds=seconds / 2))  # warm-up
                took, latencies, errors = asyncio.run(load(url, bodies, 10**9, CONCURRENCY, seconds=seconds))
                _, one, one_errors = asyncio.run(load(url, bodies, 10**9, 1, seconds=max(seconds / 3, 0.5)))
        except RuntimeError as e:
            return Measurement(candidate, 0.0, 0.0, 0.0, 0, time.monotonic() - started, failure=str(e))
        return Measurement(
            candidate,
            requests_per_s=len(latencies) / took,
            p50_ms=float(np.percentile(latencies, 50)) if len(latencies) else 0.0,
            p50_one_ms=float(np.percentile(one, 50)) if len(one) else 0.0,
            errors=sum(errors.values()) + sum(one_errors.values()),
            seconds=time.monotonic() - started,
        )

    return measure


def temporary_home() -> tempfile.TemporaryDirectory[str]:
    """A BentoML home of tune's own (its servers' logs and Prometheus folders), removed afterwards."""
    return tempfile.TemporaryDirectory(prefix="capserve-tune-")


# ------------------------------------------------------------------------------------------ the command


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model",
        help="the model folder (config.json, model.onnx; an INT8 graph in it is measured too) or NAME[:VERSION] "
        "in BentoML's model store",
    )
    p.add_argument(
        "--budget",
        type=float,
        default=DEFAULT_BUDGET_S,
        help="seconds to spend measuring (default %(default)g); the likely best candidates go first",
    )
    p.add_argument(
        "--out",
        type=Path,
        help=f"where to write the chosen settings (default MODEL/{TUNED_FILE}, which `capserve serve MODEL` reads; "
        f"another path: serve with {TUNED_VARIABLE}=PATH)",
    )


def run(args: argparse.Namespace) -> int:
    """Measure the candidates on this machine, print the table, write the tuned file."""
    if importlib.util.find_spec("bentoml") is None:
        raise UsageError("capserve tune needs BentoML: pip install 'capserve[serve]' (or capserve[gpu])")
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from capserve.model.checkpoint import read_config

    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request of the load otherwise
    if not (math.isfinite(args.budget) and args.budget > 0):  # nan compares False both ways: it would pass "<= 0"
        raise UsageError(f"--budget must be a positive number of seconds, got {args.budget:g}")
    folder = resolve_model(args.model).path
    if not (folder / "config.json").is_file():
        raise UsageError(
            f"MODEL {args.model!r} is not a model folder (no config.json): give a folder made by `capserve train` "
            "or a NAME[:VERSION] saved with `capserve export bentoml`"
        )
    out = args.out or folder / TUNED_FILE
    cpu = cpu_info()
    gpus = visible_gpus()
    console = Console(width=max(Console().width, 120))
    console.print(f"CPU: {cpu.describe()}" + (f"; {gpus} GPU(s) visible" if gpus else ""))
    console.print(f"measuring {folder} for up to {args.budget:g} s: each candidate a real server under /classify load")
    with temporary_home() as home:
        measure = measure_server(folder, read_config(folder).image_size, Path(home))
        columns = (TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn())
        with Progress(*columns, console=console, transient=True) as progress:
            task = progress.add_task("starting", total=args.budget)

            def started(candidate, number, spent):  # type: ignore[no-untyped-def]
                progress.update(task, completed=min(spent, args.budget), description=f"{number}. {candidate.label()}")
                if not console.is_terminal:  # a log has no live bar: a line per candidate instead
                    console.print(f"{number}. {candidate.label()} ({spent:.0f} s of {args.budget:g} s spent)")

            tuning = tune(folder, args.budget, measure, cpu=cpu, gpus=gpus, progress=started)
    console.print(table_of(tuning, f"capserve tune {args.model}: /classify on {cpu.describe()}"))
    if tuning.skipped:
        console.print(f"not measured within --budget {args.budget:g}: " + "; ".join(c.label() for c in tuning.skipped))
    tuned = tuning.record(tuning.chosen.candidate.device)
    write_tuned(tuned, out)
    kept = [
        name for name in ("backend", "precision", "workers", "threads", "max_batch_size") if name not in tuned.settings
    ]
    if kept:
        console.print(f"not compared with another measured value, so left to the defaults: {', '.join(kept)}")
    serve = f"capserve serve {args.model}" + (f" with {TUNED_VARIABLE}={out}" if args.out else "")
    console.print(f"chosen: {tuning.chosen.candidate.label()}; written to {out} ({serve} reads it on this CPU)")
    return 0


def table_of(tuning: Tuning, title: str) -> Any:
    """``tuning``'s measurements as a rich table, the chosen one and the fastest marked."""
    from rich.table import Table

    table = Table(title=title)
    for heading in ("runtime", "workers", "threads", "batch", "req/s at 32", "p50 ms at 32", "p50 ms at 1", "errors"):
        table.add_column(heading, justify="left" if heading == "runtime" else "right")
    table.add_column("")
    best = choose(tuning.measurements, tuning.cpu.cores, tie=0.0)
    for m in tuning.measurements:
        c = m.candidate
        runtime = c.runtime + (f" ({c.artifact})" if c.artifact else "")
        head = (runtime, str(c.workers), str(c.threads), str(c.max_batch_size))
        if m.failure:
            table.add_row(*head, "-", "-", "-", "-", f"failed: {m.failure[:80]}")
            continue
        mark = "chosen" if m is tuning.chosen else ("fastest" if m is best else "")
        figures = (f"{m.requests_per_s:.1f}", f"{m.p50_ms:.1f}", f"{m.p50_one_ms:.1f}", str(m.errors))
        table.add_row(*head, *figures, mark)
    return table
