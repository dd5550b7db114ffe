"""CAPSERVE_WORKERS: how many server processes, each one's GPU or share of the cores, and the real `bentoml serve`
with two workers (both answer, threads split, /metrics counts both, one failing worker stops the server).

GPU placement runs on CPUs through strict stand-ins for ONNX Runtime's CUDA provider and TensorRT (tests/support/gpu.py)
with four fake GPUs: worker k's sessions, engine and execution context must be on GPU k.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import httpx
import pytest
import torch
from support.gpu import fake_tensorrt, strict_cuda, strict_onnxruntime_cuda
from support.server import (
    failed_start,
    random_png,
    requests_total,
    start_server,
    stop,
    upload,
    wait_ready,
)

from capserve.errors import ConfigurationError
from capserve.hardware import available_cores
from capserve.serving import Capsules, Settings
from capserve.serving import workers as W

# ------------------------------------------------------------------------------------------ settings and shares


def test_workers_and_threads_settings():
    assert Settings.from_env({}).workers == Settings.workers
    assert Settings.from_env({"CAPSERVE_WORKERS": " AUTO "}).workers is None
    s = Settings.from_env({"CAPSERVE_WORKERS": "3", "CAPSERVE_THREADS": "2"})
    assert (s.workers, s.threads) == (3, 2)
    for env, message in [
        ({"CAPSERVE_WORKERS": "many"}, "number of workers or 'auto'"),
        ({"CAPSERVE_WORKERS": "0"}, ">= 1"),
        ({"CAPSERVE_THREADS": "0"}, ">= 1"),
    ]:
        with pytest.raises(ConfigurationError, match=message):
            Settings.from_env(env)


def test_auto_is_one_worker_per_gpu_on_cuda_and_one_on_a_cpu():
    """On a CPU, auto never starts more workers than were measured at least as fast as one: without a tuned file
    (capserve.serving.tuned), one worker."""
    assert Settings().workers is None  # auto is the default
    assert W.worker_count(Settings(workers=None)) == W.AUTO_CPU_WORKERS == 1
    assert W.worker_count(Settings(workers=None, device="cuda"), gpus=4) == 4
    assert W.worker_count(Settings(workers=None, device="cuda:2"), gpus=4) == 1  # a named GPU: one worker
    assert W.worker_count(Settings(workers=3, device="cuda"), gpus=4) == 3  # a number is a number
    with pytest.raises(ConfigurationError, match="no GPU is visible"):
        W.worker_count(Settings(workers=None, device="cuda"), gpus=0)


@pytest.mark.parametrize(
    ("visible", "count"), [("0,1,2,3", 4), ("3", 1), ("", 0), ("-1", 0), ("1,-1,2", 1), ("GPU-5c9e,GPU-77aa", 2)]
)
def test_visible_gpus_reads_cuda_visible_devices_as_cuda_does(visible, count):
    assert W.visible_gpus({"CUDA_VISIBLE_DEVICES": visible}) == count


def test_cores_are_split_between_workers_and_never_oversubscribed(monkeypatch):
    cpu = Settings()
    assert [W.assign(cpu, k, 2, cores=8).threads for k in range(2)] == [4, 4]
    assert [W.assign(cpu, k, 3, cores=8).threads for k in range(3)] == [2, 2, 2]  # 6 threads on 8 cores, not 9
    assert W.assign(cpu, 3, 4, cores=2).threads == 1  # at least one
    assert W.assign(Settings(threads=3), 1, 2, cores=8).threads == 3  # CAPSERVE_THREADS says otherwise
    assert W.assign(cpu, 1, 2, cores=8).device == "cpu"
    with pytest.raises(ValueError, match="not in 0..1"):
        W.assign(cpu, 2, 2, cores=8)


def test_worker_k_serves_on_visible_gpu_k(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")  # indices are the visible ones': 0..3
    cuda = Settings(device="cuda")
    assert [W.assign(cuda, k, 4).device for k in range(4)] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert [W.assign(cuda, k, 6).device for k in range(6)][4:] == ["cuda:0", "cuda:1"]  # round robin
    assert W.assign(Settings(device="cuda:2"), 1, 2).device == "cuda:2"  # a named GPU is every worker's
    assert W.assign(cuda, 0, 1).device == "cuda"  # one worker: the current device


def test_available_cores_honours_a_cgroup_cpu_limit(tmp_path):
    """A container's CPU limit (cgroup quota) is not in the CPU affinity: a 2-CPU pod on a big node must not start
    a thread per node core."""
    affinity = available_cores(tmp_path / "none")
    (tmp_path / "cpu.max").write_text("150000 100000\n")  # 1.5 CPUs (cgroup v2)
    assert available_cores(tmp_path) == min(affinity, 2)
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert available_cores(tmp_path) == affinity
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("100000")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000")
    assert available_cores(v1) == 1
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1")
    assert available_cores(v1) == affinity


@pytest.mark.parametrize("given", ["folder", "file"])
def test_one_worker_sessions_use_its_share_of_the_cores(tiny_cifar10, given):
    """A worker's three ONNX Runtime sessions (lone requests, explanations, batches) run on its threads only, the
    model given as its folder or as its graph file (whose explanation graph lies beside it)."""
    worker = W.Worker(index=1, count=2, device="cpu", threads=2)
    model = tiny_cifar10 if given == "folder" else tiny_cifar10 / "model.onnx"
    capsules = Capsules(Settings(model=str(model), multilabel_model="none"), worker=worker)
    lone = capsules.runtime.session.get_session_options()
    explain = capsules.explainer.session.get_session_options()
    batch = capsules.batchers[False].runtime.session.get_session_options()
    assert (lone.intra_op_num_threads, explain.intra_op_num_threads, batch.intra_op_num_threads) == (2, 2, 1)
    assert capsules.batchers[False].in_flight == 2  # two one-thread batches: 2 threads, its share
    one = Capsules(Settings(model=str(model), multilabel_model="none"), worker=W.Worker(0, 2, "cpu", 1))
    assert one.batchers[False].runtime.session.get_session_options().intra_op_num_threads == 1
    assert one.batchers[False].in_flight == 1  # never two threads on a one-core share
    described = capsules.describe()
    assert (described["worker"], described["workers"], described["threads"]) == (1, 2, 2)


def test_torch_batches_run_on_a_split_of_the_worker_cores_beside_lone_requests_on_all(tiny_cifar10):
    """As with ONNX Runtime's sessions: two one-thread batches at once on a 2-thread share, and lone requests on both
    threads; the same weights (no second copy of the model)."""
    settings = Settings(model=str(tiny_cifar10), multilabel_model="none", backend="torch", precision="fp32")
    threads = torch.get_num_threads()
    capsules = Capsules(settings, worker=W.Worker(index=0, count=1, device="cpu", threads=2))
    batches = capsules.batchers[False]
    assert (capsules.runtime.threads, batches.runtime.threads, batches.in_flight) == (2, 1, 2)
    assert batches.runtime.model is capsules.runtime.model
    one = Capsules(settings, worker=W.Worker(index=0, count=2, device="cpu", threads=1))
    assert (one.runtime.threads, one.batchers[False].runtime.threads, one.batchers[False].in_flight) == (1, 1, 1)
    assert capsules.describe()["batching"]["batches_in_flight"] == 2
    assert torch.get_num_threads() == threads  # opening and warming up left this thread's count alone


# ------------------------------------------------------------------------------------------ GPU placement


def test_onnxruntime_cuda_worker_k_runs_every_session_on_gpu_k(tiny_cifar10, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    sessions = strict_onnxruntime_cuda(monkeypatch, gpus=4)
    settings = Settings(model=str(tiny_cifar10), multilabel_model="none", device="cuda", workers=None)
    count = W.worker_count(settings)
    assert count == 4
    for k in range(count):
        sessions.clear()
        capsules = Capsules(settings, worker=W.assign(settings, k, count))
        assert capsules.ready
        assert len(sessions) == 2 and [s.device_id for s in sessions] == [k, k], "predictions and explanations"
        assert capsules.runtime.providers[0] == "CUDAExecutionProvider"
        assert capsules.describe()["device"] == f"cuda:{k}"


def test_tensorrt_worker_k_builds_its_engine_and_context_on_gpu_k(tiny_cifar10, tmp_path, monkeypatch):
    import capserve.export.tensorrt as export_trt
    from capserve.export.tensorrt import build_engine

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    trt = fake_tensorrt(profile=(1, 32))
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setattr(export_trt, "gpu_name", lambda device="cuda": "NVIDIA H200")
    strict_cuda(monkeypatch, gpus=4)
    sessions = strict_onnxruntime_cuda(monkeypatch, gpus=4)  # the explanation graph runs on ONNX Runtime
    folder = tmp_path / "model"
    folder.mkdir()
    for name in ("config.json", "model.safetensors", "model.onnx", "model-explain.onnx"):
        (folder / name).write_bytes((tiny_cifar10 / name).read_bytes())
    build_engine(folder / "model.onnx", folder / "model.plan", 1, 8, 32)
    settings = Settings(model=str(folder), multilabel_model="none", backend="tensorrt", device="cuda", workers=None)
    for k in range(W.worker_count(settings)):
        trt.engines.clear()
        sessions.clear()
        capsules = Capsules(settings, worker=W.assign(settings, k, 4))
        assert [e.device for e in trt.engines] == [k]
        assert [c.engine.device for c in trt.engines[0].contexts] == [k]
        assert capsules.runtime.memory.stream.device.index == k
        assert capsules.runtime.providers == [f"TensorRT:cuda:{k}"]
        # the explanation graph's session (the stand-in engine runs its graph on a CPU session of its own)
        assert [s.device_id for s in sessions if "CUDAExecutionProvider" in s.requested] == [k]
    assert trt.violations == []


# ------------------------------------------------------------------------------------------ the real server


FAIL_HOOK = """
import importlib.machinery
import os
import sys


class FailWorker:
    # test-only: worker CAPSERVE_TEST_FAIL_WORKER of the server cannot start. It patches capserve.serving.app as
    # that is imported: importing it here, before BentoML configures logging, would leave its logger disabled

    def find_spec(self, name, path, target=None):
        if name != "capserve.serving.app":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            warm_up = module.Capsules._warm_up

            def _warm_up(capsules):
                if capsules.worker.index == int(os.environ["CAPSERVE_TEST_FAIL_WORKER"]):
                    raise module.ConfigurationError(f"worker {capsules.worker.index}: its GPU fell off the bus")
                return warm_up(capsules)

            module.Capsules._warm_up = _warm_up

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("CAPSERVE_TEST_FAIL_WORKER"):
    sys.meta_path.insert(0, FailWorker())
"""


@pytest.mark.slow
def test_two_workers_answer_split_the_cores_and_share_metrics(tiny_cifar10, tmp_path):
    proc, url, log = start_server(
        tmp_path,
        CAPSERVE_MODEL=str(tiny_cifar10),
        CAPSERVE_MULTILABEL_MODEL="none",
        CAPSERVE_WORKERS="2",
        CAPSERVE_MAX_BATCH_SIZE="8",
    )
    try:
        wait_ready(proc, url, log)
        seen: dict[int, dict] = {}
        for _ in range(60):  # a new connection each time: the kernel hands them to either worker
            model = httpx.get(f"{url}/model", timeout=30).json()
            seen[model["worker"]] = model
            if len(seen) == 2:
                break
        assert set(seen) == {0, 1}, f"only worker(s) {set(seen)} answered:\n{log.read_text()[-2000:]}"
        share = max(1, available_cores() // 2)
        assert all(m["workers"] == 2 and m["threads"] == share and m["device"] == "cpu" for m in seen.values())
        assert all(m["lone_request_threads"] == share for m in seen.values())  # its own share, nothing lent

        before = requests_total(httpx.Client(base_url=url, timeout=30), "/classify")

        async def send(n: int) -> list[int]:
            async def one(i: int) -> int:
                async with httpx.AsyncClient(base_url=url, timeout=60) as client:  # its own connection
                    return (await client.post("/classify", **upload(random_png(i)))).status_code

            return await asyncio.gather(*(one(i) for i in range(n)))

        assert asyncio.run(send(40)) == [200] * 40
        with httpx.Client(base_url=url, timeout=30) as client:
            totals = [requests_total(client, "/classify") for _ in range(6)]  # /metrics from either worker
        assert all(t - before == 40 for t in totals), (before, totals)
    finally:
        stop(proc)


@pytest.mark.slow
def test_one_failing_worker_stops_the_whole_server_with_status_3(tiny_cifar10, tmp_path):
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(FAIL_HOOK)
    root = str(Path(__file__).resolve().parents[2])
    log = failed_start(
        tmp_path,
        CAPSERVE_MODEL=str(tiny_cifar10),
        CAPSERVE_WORKERS="2",
        CAPSERVE_TEST_FAIL_WORKER="1",
        PYTHONPATH=f"{hooks}:{root}",
    )
    assert "worker 1: its GPU fell off the bus" in log


def test_auto_workers_on_cuda_without_a_gpu_fails_startup_in_one_line(tiny_cifar10, tmp_path):
    log = failed_start(
        tmp_path,
        CAPSERVE_MODEL=str(tiny_cifar10),
        CAPSERVE_WORKERS="auto",
        CAPSERVE_DEVICE="cuda",
        CUDA_VISIBLE_DEVICES="",
    )
    assert "no GPU is visible" in log and "Traceback" not in log
