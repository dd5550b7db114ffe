"""`capserve tune` and the tuned file: the choice among measured candidates, the order and the budget, the precedence
env > tuned file from this CPU > defaults, a file from another CPU ignored, GET /model's sources, and one real tune.

The measured decisions run on stand-in measurements and a stand-in clock whose figures the test sets: no test here
depends on how fast the machine is.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from capserve.errors import ConfigurationError
from capserve.hardware import CpuInfo
from capserve.serving import Capsules, Settings
from capserve.serving import workers as W
from capserve.serving.process import settings_or_exit
from capserve.serving.schemas import ServerDescription
from capserve.serving.tune import TIE, Candidate, Measurement, choose, tune
from capserve.serving.tuned import TUNED_FILE, TUNED_VARIABLE, Tuned, apply_tuned, read_tuned, write_tuned

HERE = CpuInfo("Test CPU 9000", "x86_64", 4, frozenset({"avx2", "fma"}))
ELSEWHERE = dataclasses.replace(HERE, model="Other CPU 100")
FP32 = Candidate(workers=1, threads=4)
TWO = Candidate(workers=2, threads=2)
BF16 = Candidate("torch bf16", backend="torch", precision="bf16", workers=1, threads=4)


def measured(candidate: Candidate, rps: float, errors: int = 0, seconds: float = 10.0) -> Measurement:
    return Measurement(candidate, rps, 100.0, 10.0, errors, seconds)


# ------------------------------------------------------------------------------------------ the choice


def test_the_choice_is_the_most_requests_per_second():
    runs = [measured(FP32, 100.0), measured(TWO, 130.0), measured(BF16, 120.0)]
    assert choose(runs, cores=4).candidate == TWO


def test_a_near_tie_goes_to_the_simpler_configuration():
    """Within TIE the difference is noise on a shared machine: one worker and the default runtime win it."""
    runs = [measured(TWO, 100.0), measured(FP32, 100.0 * (1 - TIE / 2)), measured(BF16, 100.0)]
    assert choose(runs, cores=4).candidate == FP32
    runs = [measured(TWO, 100.0), measured(FP32, 100.0 * (1 - 2 * TIE))]  # beyond the tie: the faster
    assert choose(runs, cores=4).candidate == TWO


def test_the_choice_is_within_five_percent_of_the_best_measured():
    rng = random.Random(0)
    pool = [Candidate(workers=w, threads=t, max_batch_size=b) for w in (1, 2) for t in (1, 2) for b in (16, 32, 64)]
    for _ in range(200):
        runs = [measured(c, rng.uniform(20, 200), errors=int(rng.random() < 0.2)) for c in pool]
        if not any(m.valid for m in runs):
            continue
        best = max(m.requests_per_s for m in runs if m.valid)
        assert choose(runs, cores=2).requests_per_s >= 0.95 * best


def test_candidates_with_errors_or_a_failed_start_are_never_chosen():
    runs = [
        measured(TWO, 500.0, errors=3),
        Measurement(BF16, 0, 0, 0, 0, 1.0, failure="exited with 3"),
        measured(FP32, 50),
    ]
    assert choose(runs, cores=4).candidate == FP32
    with pytest.raises(ValueError, match="no candidate"):
        choose(runs[:2], cores=4)


# ------------------------------------------------------------------------------------------ order and budget


class StandIn:
    """A measurement whose figures the test sets, on a clock it advances by each measurement's seconds."""

    def __init__(self, rps: dict[str, float], seconds: float = 20.0):
        self.rps, self.seconds, self.now, self.calls = rps, seconds, 0.0, []

    def clock(self) -> float:
        return self.now

    def __call__(self, candidate: Candidate, load_s: float) -> Measurement:
        assert isinstance(candidate, Candidate) and load_s > 0  # the real measure's contract
        self.calls.append(candidate)
        self.now += self.seconds
        key = f"{candidate.runtime} {candidate.workers}x{candidate.threads} b{candidate.max_batch_size}"
        return measured(candidate, self.rps.get(key, self.rps.get(candidate.runtime, 10.0)), seconds=self.seconds)


def test_the_likely_best_go_first_and_each_step_follows_the_best_of_the_one_before(tmp_path):
    standin = StandIn({"onnxruntime fp32": 50.0, "torch bf16": 80.0, "torch bf16 2x2 b32": 90.0})
    result = tune(tmp_path, 1000, standin, cpu=HERE, clock=standin.clock, candidates=[FP32, BF16])
    assert standin.calls[:2] == [FP32, BF16]  # the runtimes, the default first
    assert {c.runtime for c in standin.calls[2:]} == {"torch bf16"}  # then workers x threads of the best runtime
    assert [c.max_batch_size for c in standin.calls[-2:]] == [16, 64]  # then its batch sizes
    assert all(c.workers == 2 and c.threads == 2 for c in standin.calls[-2:])  # around the best workers x threads
    assert result.chosen.candidate == dataclasses.replace(BF16, workers=2, threads=2) and not result.skipped


def test_tune_stops_within_its_budget_and_says_what_it_left(tmp_path):
    standin = StandIn({}, seconds=20.0)
    result = tune(tmp_path, 70, standin, cpu=HERE, clock=standin.clock, candidates=[FP32, BF16])
    assert len(standin.calls) == 3 and standin.now <= 70  # 3 x 20 s; a fourth would end past the budget
    assert result.skipped and standin.calls[0] == FP32
    tiny = StandIn({}, seconds=20.0)
    assert len(tune(tmp_path, 1, tiny, cpu=HERE, clock=tiny.clock, candidates=[FP32, BF16]).measurements) == 1


def test_the_file_chooses_only_what_tune_compared(tmp_path):
    """A group of choices measured one way only (the budget ended first, or its alternatives failed) stays the
    server's default: the file does not claim it was measured best."""
    one = StandIn({}, seconds=20.0)
    assert tune(tmp_path, 1, one, cpu=HERE, clock=one.clock, candidates=[FP32, BF16]).record("cpu").settings == {}
    runtimes = StandIn({"torch bf16": 80.0}, seconds=20.0)
    tuning = tune(tmp_path, 50, runtimes, cpu=HERE, clock=runtimes.clock, candidates=[FP32, BF16])
    assert len(tuning.measurements) == 2
    assert tuning.record("cpu").settings == {"backend": "torch", "precision": "bf16"}
    failed = [measured(FP32, 50.0), Measurement(TWO, 0, 0, 0, 0, 1.0, failure="exited with 3")]
    tuning = dataclasses.replace(tuning, measurements=failed, chosen=failed[0])
    assert tuning.record("cpu").settings == {}  # a failed alternative compares nothing
    every = StandIn({"torch bf16 2x2 b64": 95.0, "torch bf16": 80.0})
    settings = (
        tune(tmp_path, 10_000, every, cpu=HERE, clock=every.clock, candidates=[FP32, BF16]).record("cpu").settings
    )
    assert settings == {"backend": "torch", "precision": "bf16", "workers": 1, "threads": 4, "max_batch_size": 32}


def test_tune_says_why_when_no_candidate_served(tmp_path):
    from capserve.errors import UsageError

    def failing(candidate: Candidate, load_s: float) -> Measurement:
        return Measurement(candidate, 0.0, 0.0, 0.0, 0, 5.0, failure="the server exited with 3: no model.onnx")

    with pytest.raises(UsageError, match="nothing written: the server exited with 3"):
        tune(tmp_path, 100, failing, cpu=HERE, candidates=[FP32])


# ------------------------------------------------------------------------------------------ the tuned file


def tuned_file(folder: Path, cpu: CpuInfo = HERE, device: str = "cpu", **settings) -> Path:
    chosen = {"backend": "onnxruntime", "precision": "auto", "workers": 2, "threads": 1, "max_batch_size": 16}
    record = Tuned(cpu={**cpu.to_dict(), "cores": cpu.cores}, device=device, settings=chosen | settings)
    write_tuned(record, folder / TUNED_FILE)
    return folder / TUNED_FILE


def settings_of(env: dict[str, str], cpu: CpuInfo = HERE) -> Settings:
    return apply_tuned(Settings.from_env(env), env, cpu=cpu)


def test_a_tuned_file_from_this_cpu_sets_what_the_environment_leaves_open(tmp_path):
    path = tuned_file(tmp_path)
    s = settings_of({"CAPSERVE_MODEL": str(tmp_path), "CAPSERVE_WORKERS": "auto"})
    assert (s.workers, s.threads, s.max_batch_size) == (2, 1, 16)
    assert W.worker_count(s) == 2  # auto follows the measurement
    source = f"tuned ({path.name}, {HERE.describe()})"
    assert s.sources["workers"] == s.sources["threads"] == s.sources["max_batch_size"] == source
    assert s.sources["backend"] == s.sources["precision"] == s.sources["artifact"] == source  # the runtime, whole
    explicit = settings_of({"CAPSERVE_MODEL": str(tmp_path), "CAPSERVE_WORKERS": "1"})
    assert explicit.workers == 1 and explicit.sources["workers"] == "CAPSERVE_WORKERS"


@pytest.mark.parametrize("variable", ["CAPSERVE_WORKERS", "CAPSERVE_THREADS"])
def test_an_explicit_workers_or_threads_keeps_the_tuned_split_of_the_cores_out_whole(tmp_path, variable):
    """Threads measured for 1 worker are not given to each of 2 workers (4 threads on 2 cores), nor 2 workers
    given a thread count measured for 1 each."""
    tuned_file(tmp_path, workers=1, threads=2)
    s = settings_of({"CAPSERVE_MODEL": str(tmp_path), variable: "2"})
    assert (s.workers, s.threads) == ((2, None) if variable == "CAPSERVE_WORKERS" else (None, 2))
    assert s.sources["workers" if variable == "CAPSERVE_THREADS" else "threads"] == "default"
    assert s.max_batch_size == 16  # the rest of the file still applies


def test_without_a_tuned_file_auto_is_one_worker_on_a_cpu(tmp_path):
    s = settings_of({"CAPSERVE_MODEL": str(tmp_path)})
    assert W.worker_count(s) == 1 and s.sources["workers"] == "default" and s.max_batch_size == 32


@pytest.mark.parametrize(
    "cpu", [ELSEWHERE, dataclasses.replace(HERE, cores=8), dataclasses.replace(HERE, features=frozenset({"avx2"}))]
)
def test_a_file_tuned_on_another_cpu_is_ignored_with_a_log_line(tmp_path, caplog, cpu):
    tuned_file(tmp_path, cpu=cpu)
    with caplog.at_level(logging.WARNING, logger="capserve.serving.tuned"):
        s = settings_of({"CAPSERVE_MODEL": str(tmp_path)})
    assert W.worker_count(s) == 1 and s.max_batch_size == 32 and set(s.sources.values()) == {"default"}
    assert "ignoring the tuned file" in caplog.text
    assert f"measured on {cpu.describe()}, this machine is {HERE.describe()}" in caplog.text


def test_a_file_tuned_for_another_device_is_ignored(tmp_path, caplog):
    tuned_file(tmp_path, device="cuda")
    with caplog.at_level(logging.WARNING, logger="capserve.serving.tuned"):
        assert settings_of({"CAPSERVE_MODEL": str(tmp_path)}).workers is None
    assert "device cuda" in caplog.text


def test_an_explicit_backend_or_precision_keeps_the_tuned_runtime_out_whole(tmp_path):
    tuned_file(tmp_path, backend="torch", precision="bf16")
    tuned = settings_of({"CAPSERVE_MODEL": str(tmp_path)})
    assert (tuned.backend, tuned.precision, tuned.workers) == ("torch", "bf16", 2)
    s = settings_of({"CAPSERVE_MODEL": str(tmp_path), "CAPSERVE_BACKEND": "onnxruntime"})
    assert (s.backend, s.precision, s.workers) == ("onnxruntime", "auto", 2)  # the runtime is env's, the rest tuned
    assert s.sources["precision"] == "default" and s.sources["backend"] == "CAPSERVE_BACKEND"


def test_capserve_tuned_names_the_file_or_turns_it_off(tmp_path):
    model, elsewhere = tmp_path / "model", tmp_path / "elsewhere"
    model.mkdir()
    elsewhere.mkdir()
    path = tuned_file(elsewhere)
    assert settings_of({"CAPSERVE_MODEL": str(model), TUNED_VARIABLE: str(path)}).workers == 2
    tuned_file(model)
    assert settings_of({"CAPSERVE_MODEL": str(model), TUNED_VARIABLE: "none"}).workers is None
    with pytest.raises(ConfigurationError, match="no such file"):
        settings_of({"CAPSERVE_MODEL": str(model), TUNED_VARIABLE: str(tmp_path / "nosuch.json")})


@pytest.mark.parametrize(
    "change, message",
    [
        ({"extra": 1}, "unknown tuned file"),
        ({"settings": {"workers": 0}}, "workers=0"),
        ({"settings": {"workers": "two"}}, "workers='two'"),
        ({"settings": {"max_batch": 8}}, "unknown choice"),
        ({"settings": {"backend": "tf"}}, "backend 'tf'"),
        ({"cpu": {"model": "x"}}, "lacks"),
        ({"cpu": {"model": "x", "architecture": "x86_64", "features": "avx2", "cores": 2}}, "features must be a list"),
    ],
)
def test_a_broken_tuned_file_stops_the_server_in_one_line(tmp_path, change, message):
    data = json.loads(tuned_file(tmp_path).read_text()) | change
    (tmp_path / TUNED_FILE).write_text(json.dumps(data))
    with pytest.raises(ConfigurationError, match=message):
        settings_of({"CAPSERVE_MODEL": str(tmp_path)})
    (tmp_path / TUNED_FILE).write_text("{not json")
    with pytest.raises(ConfigurationError, match="cannot read the tuned file"):
        settings_of({"CAPSERVE_MODEL": str(tmp_path)})


def test_get_model_says_where_each_choice_came_from(tiny_cifar10, tmp_path):
    path = tuned_file(tmp_path)
    env = {
        "CAPSERVE_MODEL": str(tiny_cifar10),
        "CAPSERVE_MULTILABEL_MODEL": "none",
        TUNED_VARIABLE: str(path),
        "CAPSERVE_MAX_BATCH_SIZE": "8",
    }
    import capserve.hardware

    settings = apply_tuned(Settings.from_env(env), env, cpu=capserve.hardware.cpu_info())  # ignored: not HERE
    assert set(settings.sources.values()) == {"default", "CAPSERVE_MAX_BATCH_SIZE"}
    settings = apply_tuned(Settings.from_env(env), env, cpu=HERE)
    capsules = Capsules(settings, worker=W.assign(settings, 0, W.worker_count(settings)))
    described = capsules.describe()
    ServerDescription.model_validate(described)  # the documented schema, choices included
    choices = described["choices"]
    source = f"tuned ({TUNED_FILE}, {HERE.describe()})"
    assert choices["workers"] == {"value": 2, "set_by": source} and described["workers"] == 2
    assert choices["max_batch_size"] == {"value": 8, "set_by": "CAPSERVE_MAX_BATCH_SIZE"}
    assert choices["threads"] == {"value": 1, "set_by": source}
    assert choices["backend"] == {"value": "onnxruntime", "set_by": source}
    assert str(tmp_path) not in json.dumps(described)  # callers see no host path
    assert choices["artifact"]["value"] == "model.onnx"


# ------------------------------------------------------------------------------------------ the real thing


@pytest.mark.slow
def test_capserve_tune_writes_a_file_that_serve_reads_back(tiny_cifar10, tmp_path, capsys, monkeypatch):
    """One real candidate (a budget of one second measures only the first): a real server under real load, the
    table, the file, and `capserve serve`'s settings reading it back on this CPU."""
    from capserve.cli import main

    folder = tmp_path / "model"
    shutil.copytree(tiny_cifar10, folder)
    monkeypatch.delenv(TUNED_VARIABLE, raising=False)
    assert main(["tune", str(folder), "--budget", "1"]) == 0
    out = capsys.readouterr().out
    assert "CPU: " in out and "req/s at 32" in out and "chosen" in out and "not measured within --budget" in out
    assert "1. onnxruntime fp32" in out  # progress in a log, where no live bar shows
    assert "left to the defaults: backend, precision, workers, threads, max_batch_size" in out
    tuned = read_tuned(folder / TUNED_FILE)
    assert tuned.settings == {} and tuned.measured[0]["requests_per_s"] > 0  # one candidate compares nothing
    # without the start-up measurement, which a CPU with native bf16 would make (tests/serving/test_runtimes.py)
    env = {"CAPSERVE_MODEL": str(folder), "CAPSERVE_MULTILABEL_MODEL": "none", "CAPSERVE_MEASURE_RUNTIMES": "0"}
    settings = settings_or_exit(env)
    assert set(settings.sources.values()) == {"default"}
    assert W.worker_count(settings) == 1


def test_tune_refuses_what_it_cannot_measure_in_one_line(tmp_path, capsys):
    from capserve.cli import main

    assert main(["tune", str(tmp_path)]) == 2
    assert "not a model folder" in capsys.readouterr().err
    for budget in ("0", "nan", "inf", "-inf"):  # nan passes any "<= 0" check: it compares False both ways
        assert main(["tune", str(tmp_path), f"--budget={budget}"]) == 2
        err = capsys.readouterr().err
        assert f"--budget must be a positive number of seconds, got {budget}" in err and len(err.splitlines()) == 1


def test_errors_at_one_client_count_against_a_candidate(tmp_path, monkeypatch):
    """A configuration that answers 32 clients but fails lone requests is not chosen: the one-client phase's errors
    count in the measurement as the 32-client phase's do."""
    import contextlib

    from capserve.serving import tune as tune_module

    @contextlib.contextmanager
    def server(env, home):
        yield "http://127.0.0.1:9"  # never reached: the load below stands in for it

    async def load(url, bodies, requests, concurrency, seconds=None):  # loadtest.load's contract
        assert bodies and requests > 0 and seconds > 0
        latencies = [5.0] * 20
        return 0.5, latencies, ({"500": 4} if concurrency == 1 else {})

    monkeypatch.setattr(tune_module, "running_server", server)
    monkeypatch.setattr(tune_module, "load", load)
    lone_failures = tune_module.measure_server(tmp_path, 16, tmp_path)(FP32, 1.0)
    assert lone_failures.errors == 4 and not lone_failures.valid
    assert choose([lone_failures, measured(TWO, 10.0)], cores=4).candidate == TWO


@pytest.mark.slow
def test_the_tuned_file_travels_into_the_model_store_and_a_tag_reads_it(tiny_cifar10, tmp_path):
    """`capserve export bentoml` copies tuned.json with the model, so a server (or a bento) of NAME reads it."""
    import capserve.hardware

    folder = tmp_path / "model"
    shutil.copytree(tiny_cifar10, folder)
    tuned_file(folder, cpu=capserve.hardware.cpu_info())  # measured here
    env = {**os.environ, "BENTOML_HOME": str(tmp_path / "bentoml"), "BENTOML_DO_NOT_TRACK": "True"}
    env.pop(TUNED_VARIABLE, None)
    script = (
        "import sys; from capserve.cli import main\n"
        "from capserve.serving import Settings\n"
        "from capserve.serving.tuned import apply_tuned\n"
        "assert main(['export', 'bentoml', sys.argv[1], '--name', 'tuned-model']) == 0\n"
        "env = {'CAPSERVE_MODEL': 'tuned-model'}\n"
        "s = apply_tuned(Settings.from_env(env), env)\n"
        "print('RESULT', s.workers, s.max_batch_size, s.sources['workers'])"
    )
    command = [sys.executable, "-c", script, str(folder)]
    r = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"RESULT 2 16 tuned ({TUNED_FILE}, " in r.stdout, r.stdout + r.stderr


def test_a_tuned_artifact_is_the_graph_served_from_the_model_folder(tiny_cifar10, tmp_path):
    """A tuned file may choose another graph in the folder for onnxruntime (an INT8 one): the folder serves it,
    with the folder's explanation graph."""
    from capserve.pipeline.models import open_model

    folder = tmp_path / "model"
    shutil.copytree(tiny_cifar10, folder)
    (folder / "model.onnx").rename(folder / "other.onnx")
    tuned_file(folder, artifact="other.onnx")
    env = {"CAPSERVE_MODEL": str(folder), "CAPSERVE_MULTILABEL_MODEL": "none"}
    settings = settings_of(env)
    assert settings.artifact == "other.onnx" and settings.sources["artifact"].startswith("tuned (")
    runtime, explainer, _ = open_model(settings.model, settings)
    assert Path(runtime.path).name == "other.onnx" and explainer is not None
    with pytest.raises(ConfigurationError, match="has no model.onnx"):
        open_model(settings.model, Settings.from_env(env))  # without the tuned file: model.onnx, which is gone


@pytest.mark.parametrize(("cores", "workers"), [(2, {1, 2}), (8, {1, 2, 3, 4})])
def test_tune_measures_every_number_of_workers_up_to_the_cores(tmp_path, cores, workers):
    """On 2 cores, 2 workers is the configuration users ask about (docs/deploy.md, "Workers"): tune measures it,
    and chooses it when it serves most."""
    cpu = dataclasses.replace(HERE, cores=cores)
    standin = StandIn({"onnxruntime fp32 2x1 b32": 90.0, "onnxruntime fp32 2x4 b32": 90.0})
    result = tune(tmp_path, 10_000, standin, cpu=cpu, clock=standin.clock, candidates=[Candidate(threads=cores)])
    assert {c.workers for c in standin.calls} == workers
    assert result.chosen.candidate.workers == 2


def test_the_load_counts_every_answer_but_200_as_an_error():
    """A configuration that sheds requests (503) or fails them is not a fast one: tune scores only error-free
    measurements, so the load must count each non-200 answer."""
    import asyncio
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from capserve.serving.loadtest import load

    answered = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the server measured

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["content-length"]))
            answered.append(1)
            status = (200, 503, 500)[len(answered) % 3]
            body = b"{}"
            self.send_response(status)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        _, latencies, errors = asyncio.run(load(url, [b"png"], requests=9, concurrency=1))
    finally:
        server.shutdown()
        server.server_close()
    assert len(latencies) == 9 and errors == {"503": 3, "500": 3}


def test_the_server_reads_a_tuned_file_measured_on_this_cpu(tmp_path):
    """What `capserve serve` starts with (``settings_or_exit``, the service module's settings) takes the tuned
    file's choices, not only ``apply_tuned`` called by hand."""
    import capserve.hardware

    path = tuned_file(tmp_path, cpu=capserve.hardware.cpu_info())
    s = settings_or_exit({"CAPSERVE_MODEL": str(tmp_path), "CAPSERVE_MULTILABEL_MODEL": "none"})
    assert (s.workers, s.threads, s.max_batch_size) == (2, 1, 16)
    assert s.sources["workers"] == f"tuned ({path.name}, {capserve.hardware.cpu_info().describe()})"
