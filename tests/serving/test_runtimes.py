"""The runtime a server starts with when nothing chose it: the fastest that applies here, measured at start-up once
per model and machine (``capserve.serving.runtimes``), with settings and tuned files winning, workers taking the
server process's choice, and a real server measuring the shipped model's fp32 and INT8 graphs.

The decisions run on stand-in speeds whose figures the test sets and on stand-in CPUs (with or without native
bf16): no test here depends on which runtime is faster on the machine that runs it.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest
from support.models import tiny_model
from support.server import ROOT, export, random_png, start_server, stop, upload, wait_ready

import capserve.serving.runtimes as runtimes
from capserve.errors import ConfigurationError
from capserve.files import cache_file
from capserve.hardware import CpuInfo
from capserve.runtime.onnx_backend import OnnxRuntime
from capserve.runtime.precision import AgreementReport, Bf16Support
from capserve.serving import Capsules, Settings
from capserve.serving.process import settings_or_exit
from capserve.serving.runtimes import (
    CACHE_FILE,
    CHOSEN_VARIABLE,
    LONE_MIN_SHARE,
    MIN_SPEEDUP,
    ROUNDS,
    Candidate,
    Speed,
    choose_runtime,
    fastest_runtime,
    measure_speeds,
    workers_environment,
)
from capserve.serving.tuned import RUNTIME_CHOICES, TUNED_FILE, TUNED_VARIABLE, apply_tuned

HERE = CpuInfo("Test CPU 9000", "x86_64", 4, frozenset({"avx2", "fma", "avx512_bf16"}))
FP32 = Candidate(threads=2)
INT8 = Candidate("onnxruntime int8", artifact="model-int8.onnx", threads=2)
BF16 = Candidate("torch bf16", backend="torch", precision="bf16", threads=2)


class Speeds:
    """Images/s of each runtime, as the test sets them by ``Candidate.runtime``; records what was measured and
    holds each call to ``measure_speeds``' contract."""

    def __init__(self, **by_runtime: Speed | float | str):
        # a bare number: as fast on one image as on batches (per image)
        self.by_runtime = {
            name.replace("_", " "): Speed(speed, speed) if isinstance(speed, float) else speed
            for name, speed in by_runtime.items()
        }
        self.calls: list[tuple[list[Candidate], int, int]] = []

    def __call__(self, folder, candidates, threads, batch):
        assert Path(folder).is_dir() and (Path(folder) / "config.json").is_file()
        assert candidates and len(set(candidates)) == len(candidates) and candidates[0].runtime == "onnxruntime fp32"
        assert isinstance(threads, int) and threads >= 1 and all(c.threads == threads for c in candidates)
        assert isinstance(batch, int) and batch >= 1
        self.calls.append((list(candidates), threads, batch))
        return {c: self.by_runtime[c.runtime] for c in candidates}


def with_bf16(monkeypatch, native: bool) -> None:
    """A CPU that has (or lacks) native bf16, for the candidates: what ``native_bf16`` would report there."""
    reason = "x86_64 CPU with avx512_bf16" if native else "x86_64 CPU without bf16 instructions"
    monkeypatch.setattr(runtimes, "native_bf16", lambda: Bf16Support(native, reason))


@pytest.fixture
def folder(tiny_cifar10, tmp_path) -> Path:
    """A copy of the tiny model folder, for tests that change it."""
    out = tmp_path / "model"
    shutil.copytree(tiny_cifar10, out)
    return out


def started(folder: Path, measure, cpu: CpuInfo = HERE, **env: str) -> Settings:
    """The settings a server process starts with (``settings_or_exit``'s steps), the environment ``env``."""
    env = {"CAPSERVE_MODEL": str(folder), "CAPSERVE_MULTILABEL_MODEL": "none", "CAPSERVE_THREADS": "2", **env}
    return fastest_runtime(apply_tuned(Settings.from_env(env), env, cpu=cpu), env, cpu=cpu, measure=measure)


# ------------------------------------------------------------------------------------------ the choice


def at(batch: float, one: float = 40.0) -> Speed:
    return Speed(batch, one)


@pytest.mark.parametrize(
    ("speeds", "chosen"),
    [
        ({FP32: at(100.0), INT8: at(100.0 * MIN_SPEEDUP)}, INT8),  # exactly at the bound
        ({FP32: at(100.0), INT8: at(100.0 * MIN_SPEEDUP - 0.01)}, FP32),  # just under: noise, the default
        ({FP32: at(100.0), INT8: at(150.0), BF16: at(180.0)}, BF16),  # the fastest of several
        ({FP32: at(100.0), INT8: at(300.0), BF16: "bf16 fell back to fp32"}, INT8),  # one not served here
        ({FP32: at(100.0), INT8: at(50.0)}, FP32),  # slower
        ({FP32: "cannot load", INT8: at(300.0)}, FP32),  # nothing to compare with: the default says why it fails
        # lone requests: at the bound on one image it is chosen; below it, the next fastest that keeps it
        ({FP32: at(100.0), BF16: at(200.0, 40.0 * LONE_MIN_SHARE)}, BF16),
        ({FP32: at(100.0), BF16: at(200.0, 40.0 * LONE_MIN_SHARE - 0.01)}, FP32),
        ({FP32: at(100.0), INT8: at(150.0, 80.0), BF16: at(200.0, 30.0)}, INT8),
    ],
)
def test_another_runtime_replaces_the_default_only_when_clearly_faster_and_no_slower_alone(speeds, chosen):
    assert choose_runtime(speeds, FP32) == chosen


def test_a_server_that_nothing_chose_for_serves_the_runtime_measured_fastest(folder, monkeypatch):
    with_bf16(monkeypatch, native=True)
    speeds = Speeds(onnxruntime_fp32=100.0, torch_bf16=150.0)
    settings = started(folder, speeds)
    assert (settings.backend, settings.precision, settings.artifact) == ("torch", "bf16", None)
    [(measured, threads, batch)] = speeds.calls
    assert [c.runtime for c in measured] == ["onnxruntime fp32", "torch bf16"]
    assert (threads, batch) == (2, settings.max_batch_size)
    source = settings.sources["backend"]
    assert {settings.sources[name] for name in RUNTIME_CHOICES} == {source}  # the runtime, chosen whole
    assert source == (
        f"measured at start-up on {HERE.describe()}, 2 threads, batch 32: onnxruntime fp32 100.0 img/s, 100.0 one "
        "at a time; torch bf16 150.0 img/s, 150.0 one at a time"
    )
    assert settings.sources["workers"] == "default" and settings.sources["threads"] == "CAPSERVE_THREADS"
    speeds = Speeds(onnxruntime_fp32=100.0, torch_bf16=105.0)  # another machine's figures: not enough
    monkeypatch.setenv("CAPSERVE_CACHE_DIR", str(folder.parent / "elsewhere"))
    assert started(folder, speeds).backend == "onnxruntime"


def test_a_restart_reads_the_kept_figures_and_a_changed_model_or_machine_measures_again(folder, monkeypatch):
    """The figures are kept per model files, CPU, threads and batch: a restart measures nothing (its choice cannot
    follow the load at its start); a new graph, other threads, another CPU or a damaged cache measure again."""
    with_bf16(monkeypatch, native=True)
    first = Speeds(onnxruntime_fp32=100.0, torch_bf16=150.0)
    assert started(folder, first).backend == "torch"
    again = Speeds(onnxruntime_fp32=100.0, torch_bf16=50.0)  # a loaded machine would now measure bf16 slower
    settings = started(folder, again)
    assert settings.backend == "torch" and again.calls == []
    assert settings.sources["backend"].startswith(f"measured at an earlier start on {HERE.describe()}, 2 threads")
    assert "torch bf16 150.0 img/s, 150.0 one at a time" in settings.sources["backend"]
    assert started(folder, again, CAPSERVE_THREADS="1").backend == "onnxruntime" and len(again.calls) == 1
    assert started(folder, again, CAPSERVE_MAX_BATCH_SIZE="8").backend == "onnxruntime" and len(again.calls) == 2
    other = CpuInfo("Other CPU", "x86_64", 4, HERE.features)
    assert started(folder, again, cpu=other).backend == "onnxruntime" and len(again.calls) == 3
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config, indent=4))  # the same model, other bytes: another file
    assert started(folder, again).backend == "onnxruntime" and len(again.calls) == 4
    cache_file(CACHE_FILE).write_text("[1, 2")
    assert started(folder, first).backend == "torch" and len(first.calls) == 2


@pytest.mark.parametrize(
    "env",
    [
        {"CAPSERVE_BACKEND": "onnxruntime"},
        {"CAPSERVE_PRECISION": "fp32"},
        {"CAPSERVE_MEASURE_RUNTIMES": "0"},
    ],
)
def test_a_setting_chooses_the_runtime_without_measuring(folder, monkeypatch, env):
    with_bf16(monkeypatch, native=True)
    speeds = Speeds(onnxruntime_fp32=100.0, torch_bf16=500.0)
    settings = started(folder, speeds, **env)
    assert speeds.calls == [] and (settings.backend, settings.precision) == (
        "onnxruntime",
        env.get("CAPSERVE_PRECISION", "auto"),
    )
    assert not any(source.startswith("measured") for source in settings.sources.values())


def test_a_tuned_file_measured_here_wins_over_the_start_up_measurement(folder, monkeypatch):
    from capserve.serving.tuned import Tuned, write_tuned

    with_bf16(monkeypatch, native=True)
    tuned = Tuned(cpu={**HERE.to_dict(), "cores": HERE.cores}, device="cpu", settings={"backend": "onnxruntime"})
    write_tuned(tuned, folder / TUNED_FILE)
    speeds = Speeds(onnxruntime_fp32=100.0, torch_bf16=500.0)
    settings = started(folder, speeds)
    assert speeds.calls == [] and settings.backend == "onnxruntime"
    assert settings.sources["backend"].startswith("tuned (")
    speeds = Speeds(onnxruntime_fp32=100.0, torch_bf16=500.0)  # a file of another CPU is ignored: measured
    other = CpuInfo("Other CPU", "x86_64", 4, HERE.features)
    assert started(folder, speeds, cpu=other).backend == "torch" and len(speeds.calls) == 1


def test_with_one_runtime_that_applies_nothing_is_measured(folder, monkeypatch, tmp_path):
    """A CPU without native bf16 and a folder without an INT8 graph: the server starts as it always did. A folder
    without model.onnx is left to the server, which says what is missing; a graph file given as the model is its
    own runtime."""
    with_bf16(monkeypatch, native=False)
    speeds = Speeds(onnxruntime_fp32=100.0, torch_bf16=500.0)
    settings = started(folder, speeds)
    assert speeds.calls == [] and set(settings.sources.values()) <= {"default", "CAPSERVE_THREADS"}
    with_bf16(monkeypatch, native=True)
    assert started(folder / "model.onnx", speeds).backend == "onnxruntime" and speeds.calls == []
    (folder / "model.onnx").unlink()
    assert started(folder, speeds).backend == "onnxruntime" and speeds.calls == []


def test_workers_serve_the_server_process_choice_without_measuring(folder, monkeypatch):
    """The ``bentoml serve`` process measures and hands its choice to the workers it starts (the environment):
    a server with several workers measures once, and every worker serves the same runtime."""
    with_bf16(monkeypatch, native=True)
    server = started(folder, Speeds(onnxruntime_fp32=100.0, torch_bf16=150.0))
    handed = workers_environment(server)
    assert list(handed) == [CHOSEN_VARIABLE]

    def never(*args):
        raise AssertionError("a worker measured")

    worker = started(folder, never, **handed)
    assert (worker.backend, worker.precision, worker.artifact) == (server.backend, server.precision, server.artifact)
    assert worker.sources == server.sources
    assert workers_environment(started(folder, never, CAPSERVE_MEASURE_RUNTIMES="0")) == {}
    with pytest.raises(ConfigurationError, match=f"{CHOSEN_VARIABLE} is set by capserve's server process only"):
        started(folder, never, **{CHOSEN_VARIABLE: "{not json"})


def test_the_server_process_puts_its_choice_in_the_environment_its_workers_inherit(folder, monkeypatch):
    with_bf16(monkeypatch, native=True)
    monkeypatch.setattr(runtimes, "measure_speeds", Speeds(onnxruntime_fp32=100.0, torch_bf16=150.0))
    monkeypatch.setattr(runtimes, "cpu_info", lambda: HERE)
    monkeypatch.setenv(CHOSEN_VARIABLE, "")  # restored (removed) after the test: settings_or_exit sets it
    env = {"CAPSERVE_MODEL": str(folder), "CAPSERVE_MULTILABEL_MODEL": "none", TUNED_VARIABLE: "none"}
    settings = settings_or_exit(env)
    import os

    assert settings.backend == "torch" and json.loads(os.environ[CHOSEN_VARIABLE])["runtime"]["backend"] == "torch"


# ------------------------------------------------------------------------------------------ the measurement


@pytest.fixture
def predictions(monkeypatch) -> list[str]:
    """The graph file and batch size of every ONNX Runtime prediction, in order."""
    calls: list[tuple[str, int]] = []
    real = OnnxRuntime._predict

    def counted(self, batch):
        calls.append((Path(self.path).name, len(batch)))
        return real(self, batch)

    monkeypatch.setattr(OnnxRuntime, "_predict", counted)
    return calls


def test_each_runtime_is_opened_as_the_server_opens_it_and_timed_in_interleaved_rounds(folder, predictions):
    shutil.copy(folder / "model.onnx", folder / "copy.onnx")
    copy, missing = Candidate(artifact="copy.onnx", threads=1), Candidate(artifact="missing.onnx", threads=1)
    speeds = measure_speeds(folder, [Candidate(threads=1), copy, missing], threads=1, batch=4)
    for measured in (speeds[Candidate(threads=1)], speeds[copy]):
        assert isinstance(measured, Speed) and measured.batch > 0 and measured.one > 0
    assert "has no missing.onnx" in speeds[missing]  # the server's own message
    # a warm-up, then rounds, interleaved: each a batch and one image
    assert predictions == [(name, size) for name in ("model.onnx", "copy.onnx") for size in (4, 1)] * (1 + ROUNDS)


def test_the_measurement_stops_at_its_budget_with_a_round_of_each(folder, predictions):
    shutil.copy(folder / "model.onnx", folder / "copy.onnx")
    ticks = iter(range(0, 10**6, 1000))  # every reading of the clock is past the budget
    candidates = [Candidate(threads=1), Candidate(artifact="copy.onnx", threads=1)]
    speeds = measure_speeds(folder, candidates, threads=1, batch=2, clock=lambda: float(next(ticks)))
    assert all(isinstance(s, Speed) for s in speeds.values())
    assert predictions == [(name, size) for name in ("model.onnx", "copy.onnx") for size in (2, 1)] * 2


def test_bf16_that_disagrees_with_fp32_is_not_a_runtime_to_serve(folder, monkeypatch):
    """Opened as the server opens it, bf16 whose decisions disagree falls back to fp32: it is dropped, with why."""
    import capserve.runtime.precision as precision

    def disagrees(runtime, bound=0.9, count=64):
        return AgreementReport(agreement=0.5, images=count, bound=bound, measure="top-1", max_abs_logit=3.0)

    monkeypatch.setattr(precision, "check_bf16", disagrees)
    speeds = measure_speeds(folder, [Candidate(threads=1), BF16], threads=1, batch=2)
    assert isinstance(speeds[Candidate(threads=1)], Speed)
    assert speeds[BF16].startswith("fell back from bf16: bf16 vs fp32 top-1 agreement 0.5000")


# ------------------------------------------------------------------------------------------ what is served


def test_the_multilabel_model_serves_the_chosen_graph_name_where_its_folder_has_one(folder, tmp_path, caplog):
    """The graph a measurement or a tuned file chose is the single-label folder's: the multi-label model serves its
    graph of the same name where it has one that opens here, else its model.onnx."""
    multi = export(tiny_model("multimnist-matrix-small"), tmp_path / "multimnist", explain=False)
    shutil.copy(folder / "model.onnx", folder / "other.onnx")
    env = {"CAPSERVE_MODEL": str(folder), "CAPSERVE_MULTILABEL_MODEL": str(multi), "CAPSERVE_THREADS": "1"}
    import dataclasses

    settings = dataclasses.replace(Settings.from_env(env), artifact="other.onnx")
    with caplog.at_level("INFO", logger="capserve"):
        capsules = Capsules(settings)
    assert Path(capsules.runtime.path).name == "other.onnx"
    assert Path(capsules.multilabel_runtime.path).name == "model.onnx"
    assert f"{multi} has no other.onnx: serving its model.onnx" in caplog.text  # an expected state: no warning
    assert not [r for r in caplog.records if r.levelname == "WARNING" and "other.onnx" in r.getMessage()]
    caplog.clear()
    shutil.copy(multi / "model.onnx", multi / "other.onnx")
    assert Path(Capsules(settings).multilabel_runtime.path).name == "other.onnx"
    (multi / "other.onnx").write_bytes((multi / "model.onnx").read_bytes()[:1000])  # one that does not open here
    with caplog.at_level("WARNING", logger="capserve"):
        assert Path(Capsules(settings).multilabel_runtime.path).name == "model.onnx"
    assert f"serving {multi}'s model.onnx instead: cannot load the model" in caplog.text


@pytest.mark.slow
def test_the_default_server_measures_the_shipped_graphs_once_and_a_restart_reads_them(tmp_path):
    """``capserve serve``'s default path on the shipped model: the server process measures ONNX Runtime fp32 against
    the shipped INT8 graph (and torch bf16 on a CPU with it), two workers serve its choice, GET /model names the
    measurement, /classify answers; the restart measures nothing. Which runtime wins is this CPU's business."""
    model = ROOT / "models" / "cifar10"
    assert (model / "model-int8.onnx").is_file()
    env = dict(CAPSERVE_MODEL=str(model), CAPSERVE_MULTILABEL_MODEL="none", CAPSERVE_MEASURE_RUNTIMES="1")
    env.update(CAPSERVE_WORKERS="2", CAPSERVE_UI="0", CAPSERVE_CACHE_DIR=str(tmp_path / "cache"))
    logs = []
    for start in ("at start-up", "at an earlier start"):
        proc, url, log = start_server(tmp_path, **env)
        try:
            wait_ready(proc, url, log)
            described = httpx.get(f"{url}/model", timeout=30).json()
            r = httpx.post(f"{url}/classify", **upload(random_png(0)), timeout=60)
        finally:
            stop(proc)
        text = log.read_text()
        logs.append(text)
        assert r.status_code == 200, r.text
        choices = described["choices"]
        source = choices["backend"]["set_by"]
        assert source.startswith(f"measured {start} on ") and "onnxruntime int8 (model-int8.onnx)" in source
        assert {choices[name]["set_by"] for name in RUNTIME_CHOICES} == {source}
        pattern = r"(onnxruntime fp32|onnxruntime int8 \(model-int8.onnx\)) ([\d.]+) img/s, ([\d.]+) one at a time"
        figures = {name: Speed(float(b), float(o)) for name, b, o in re.findall(pattern, source)}
        assert len(figures) == 2 and all(s.batch > 0 and s.one > 0 for s in figures.values())
        if described["single_label"]["backend"] == "onnxruntime":  # (torch bf16 on a CPU that has it)
            candidates = {"onnxruntime fp32": Candidate(threads=1), "onnxruntime int8 (model-int8.onnx)": INT8}
            chosen = choose_runtime({candidates[name]: s for name, s in figures.items()}, Candidate(threads=1))
            assert described["single_label"]["precision"] == ("int8" if chosen == INT8 else "fp32")
        assert str(tmp_path) not in json.dumps(described)
    measuring = re.compile(r"measuring \d runtimes for ")
    assert len(measuring.findall(logs[0])) == 1 and not measuring.findall(logs[1])
    assert np.all([text.count("capserve ready") == 2 for text in logs])
