"""Runtime backends: ONNX Runtime errors and options, TensorRT sidecar checks and engine build/run.

TensorRT and GPUs are absent from CI: the real-engine test skips with the reason, and everything else runs
without them (sidecar checks, argument validation, the "not installed" errors, and the builder's and
runtime's calls against a stand-in ``tensorrt`` module that records them).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from support.gpu import CURRENT_DEVICE, fake_tensorrt, strict_cuda
from support.models import tiny_input, tiny_model

from capserve.errors import InputError, RuntimeLoadError
from capserve.runtime import ModelMetadata, load_runtime
from capserve.runtime.onnx_backend import OnnxRuntime, providers_for
from capserve.runtime.tensorrt_backend import TENSORRT_MISSING, EngineSidecar, TensorRTRuntime, sidecar_path

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from capserve.errors import ExportError  # noqa: E402
from capserve.export.onnx import export_onnx  # noqa: E402
from capserve.export.tensorrt import build_engine, read_onnx  # noqa: E402

HAS_TENSORRT = importlib.util.find_spec("tensorrt") is not None
NAME = "cifar10-simple"


@pytest.fixture(scope="module")
def model():
    return tiny_model(NAME)


@pytest.fixture(scope="module")
def onnx_file(model, tmp_path_factory):
    return export_onnx(model, tmp_path_factory.mktemp("rt") / "model.onnx", 2)


@pytest.fixture(scope="module")
def runtime(onnx_file):
    return OnnxRuntime(onnx_file)


def test_predict_and_interface(runtime, model):
    x = tiny_input(model, 4)
    with torch.no_grad():
        expected = model(x, iterations=2).numpy()
    assert np.abs(runtime.predict(x.numpy()) - expected).max() <= 1e-4
    assert runtime.backend == "onnxruntime" and runtime.providers == ["CPUExecutionProvider"]
    assert runtime.metadata.name == NAME and runtime.metadata.iterations == 2
    options = runtime.session.get_session_options()
    for key in ("session.intra_op.allow_spinning", "session.inter_op.allow_spinning"):
        assert options.get_session_config_entry(key) == "0"


@pytest.mark.parametrize("batch_size", [1, 3, 7, 64])
def test_predict_in_batches_equals_one_call_for_any_batch_size(runtime, model, batch_size):
    x = tiny_input(model, 7).numpy()
    np.testing.assert_allclose(runtime.predict_in_batches(x, batch_size), runtime.predict(x), atol=1e-5)


def test_predict_in_batches_refuses_what_predict_refuses(runtime, model):
    with pytest.raises(InputError, match="B >= 1"):  # an empty batch is the caller's mistake, said as for predict
        runtime.predict_in_batches(tiny_input(model, 0).numpy(), 4)
    with pytest.raises(ValueError, match="batch_size"):
        runtime.predict_in_batches(tiny_input(model, 2).numpy(), 0)


def test_graph_optimization_levels_agree(onnx_file, runtime, model):
    x = tiny_input(model, 3).numpy()
    reference = runtime.predict(x)
    for level in ("disable", "basic", "extended"):
        np.testing.assert_allclose(OnnxRuntime(onnx_file, graph_optimization=level).predict(x), reference, atol=1e-5)
    with pytest.raises(ValueError, match="graph_optimization"):
        OnnxRuntime(onnx_file, graph_optimization="max")


def test_providers(onnx_file):
    assert providers_for("cpu") == ["CPUExecutionProvider"]
    # HEURISTIC: no cuDNN benchmark per new batch size (adaptive batching sends every size up to its limit)
    cuda = ("CUDAExecutionProvider", {"device_id": 1, "cudnn_conv_algo_search": "HEURISTIC"})
    assert providers_for("cuda:1") == [cuda, "CPUExecutionProvider"]
    with pytest.raises(ValueError, match="device"):
        providers_for("tpu")
    with pytest.raises(ValueError, match="device"):
        providers_for("cuda:x")
    assert OnnxRuntime(onnx_file, providers=["CPUExecutionProvider"]).providers == ["CPUExecutionProvider"]


def test_onnxruntime_and_onnxruntime_gpu_together_is_an_error(onnx_file, monkeypatch):
    import capserve.runtime.onnx_backend as backend

    assert backend.installed_onnxruntimes() == ["onnxruntime"]  # this CPU machine's install is not mixed
    monkeypatch.setattr(backend, "installed_onnxruntimes", lambda: ["onnxruntime", "onnxruntime-gpu"])
    with pytest.raises(RuntimeLoadError, match=r"pip install 'capserve\[gpu\]'"):
        OnnxRuntime(onnx_file)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only torch error on a machine without a GPU")
def test_torch_backend_on_cuda_without_cuda_is_a_clear_error(tmp_path):
    """The GPU image's CPU torch wheel raised an uncaught AssertionError here (BentoML respawned the worker)."""
    tiny_model(NAME).save(tmp_path / "m")
    with pytest.raises(RuntimeLoadError, match="use the onnxruntime backend"):
        load_runtime(tmp_path / "m", "torch", "cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback error on a machine without a GPU")
def test_requested_gpu_provider_not_in_use_is_an_error(onnx_file):
    with pytest.raises(RuntimeLoadError, match="CUDAExecutionProvider was requested but the session runs on"):
        OnnxRuntime(onnx_file, device="cuda")
    with pytest.raises(RuntimeLoadError, match="TensorrtExecutionProvider was requested"):
        OnnxRuntime(onnx_file, providers=["TensorrtExecutionProvider", "CPUExecutionProvider"])


def test_bad_inputs_give_clear_errors(runtime):
    good = np.zeros((2, 3, 32, 32), np.float32)
    assert runtime.predict(good).shape == (2, 10)
    with pytest.raises(InputError, match=r"shape \(B, 3, 32, 32\)"):
        runtime.predict(np.zeros((2, 3, 28, 28), np.float32))
    with pytest.raises(InputError, match="shape"):
        runtime.predict(np.zeros((3, 32, 32), np.float32))
    with pytest.raises(InputError, match="B >= 1"):
        runtime.predict(np.zeros((0, 3, 32, 32), np.float32))
    with pytest.raises(InputError, match="float32"):
        runtime.predict(good.astype(np.float64))
    with pytest.raises(InputError, match="float32"):
        runtime.predict(good.astype(np.uint8))
    with pytest.raises(InputError, match="numpy array"):
        runtime.predict(good.tolist())


def test_corrupt_truncated_and_foreign_files(onnx_file, tmp_path):
    data = onnx_file.read_bytes()
    (tmp_path / "truncated.onnx").write_bytes(data[: len(data) // 2])
    (tmp_path / "garbage.onnx").write_bytes(b"\x08\x07 this is not a protobuf" * 50)
    (tmp_path / "empty.onnx").write_bytes(b"")
    for name in ("truncated", "garbage", "empty"):
        with pytest.raises(RuntimeLoadError, match="not a loadable ONNX model"):
            load_runtime(tmp_path / f"{name}.onnx")
    proto = onnx.load(str(onnx_file))
    del proto.metadata_props[:]
    onnx.save(proto, str(tmp_path / "bare.onnx"))
    with pytest.raises(RuntimeLoadError, match="capserve export onnx"):
        load_runtime(tmp_path / "bare.onnx")
    with pytest.raises(RuntimeLoadError, match="does not exist"):
        load_runtime(tmp_path / "missing.onnx")


# --- TensorRT without TensorRT --------------------------------------------------------------------------------


def sidecar_for(engine: bytes, **changes) -> EngineSidecar:
    meta = ModelMetadata.from_config(tiny_model(NAME).config, 2)
    fields = dict(
        tensorrt_version="10.13.0",
        gpu_name="NVIDIA H200",
        onnx_sha256="ab" * 32,
        engine_sha256=__import__("hashlib").sha256(engine).hexdigest(),
        min_batch=1,
        opt_batch=8,
        max_batch=32,
        input_name="images",
        outputs=("logits",),
        precision="fp32",
        metadata=meta,
    )
    return EngineSidecar(**{**fields, **changes})


def test_sidecar_round_trip_and_checks(tmp_path):
    engine = tmp_path / "model.plan"
    engine.write_bytes(b"engine bytes")
    sidecar = sidecar_for(b"engine bytes")
    assert sidecar_path(engine).name == "model.plan.json"
    sidecar_path(engine).write_text(sidecar.to_json())
    assert EngineSidecar.read(sidecar_path(engine)) == sidecar
    sidecar.check(engine, b"engine bytes", "10.13.0", "NVIDIA H200")
    with pytest.raises(RuntimeLoadError, match=r"built with TensorRT 10\.13\.0 but TensorRT 11\.0\.0 is installed"):
        sidecar.check(engine, b"engine bytes", "11.0.0", "NVIDIA H200")
    with pytest.raises(RuntimeLoadError, match="built for 'NVIDIA H200' but this GPU is 'NVIDIA L4'"):
        sidecar.check(engine, b"engine bytes", "10.13.0", "NVIDIA L4")
    with pytest.raises(RuntimeLoadError, match="engine_sha256"):
        sidecar.check(engine, b"engine byte", "10.13.0", "NVIDIA H200")
    sidecar.check_batch_size(1)
    sidecar.check_batch_size(32)
    with pytest.raises(InputError, match=r"batch of 33 is outside the engine's optimisation profile \[1, 32\]"):
        sidecar.check_batch_size(33)
    with pytest.raises(ValueError, match="min <= opt <= max"):
        sidecar_for(b"", min_batch=8, opt_batch=4)


def test_sidecar_errors(tmp_path):
    engine = tmp_path / "model.plan"
    engine.write_bytes(b"x")
    with pytest.raises(RuntimeLoadError, match="sidecar"):
        TensorRTRuntime(engine)
    for text in ("{not json", "[]", json.dumps({"format_version": 99}), json.dumps({"format_version": 1, "x": 1})):
        sidecar_path(engine).write_text(text)
        with pytest.raises(RuntimeLoadError, match="not a valid engine sidecar"):
            load_runtime(engine, device="cuda")
    with pytest.raises(ValueError, match="GPU"):
        TensorRTRuntime(engine, device="cpu")


@pytest.mark.skipif(HAS_TENSORRT, reason="checks the error shown where TensorRT is not installed")
def test_tensorrt_not_installed(tmp_path, onnx_file):
    engine = tmp_path / "model.plan"
    engine.write_bytes(b"engine bytes")
    sidecar_path(engine).write_text(sidecar_for(b"engine bytes").to_json())
    with pytest.raises(RuntimeLoadError, match="TensorRT is not installed"):
        load_runtime(engine, device="cuda")
    with pytest.raises(ExportError, match="TensorRT is not installed"):
        build_engine(onnx_file, tmp_path / "m.plan")


def test_build_engine_validates_before_tensorrt(tmp_path, onnx_file):
    with pytest.raises(ExportError, match="--min-batch <= --opt-batch"):
        build_engine(onnx_file, tmp_path / "m.plan", 4, 2, 8)
    with pytest.raises(ExportError, match="not found"):
        build_engine(tmp_path / "missing.onnx", tmp_path / "m.plan")
    (tmp_path / "bad.onnx").write_bytes(onnx_file.read_bytes()[:1000])
    with pytest.raises(ExportError, match="not a valid ONNX model"):
        build_engine(tmp_path / "bad.onnx", tmp_path / "m.plan")
    proto = onnx.load(str(onnx_file))
    del proto.metadata_props[:]
    onnx.save(proto, str(tmp_path / "bare.onnx"))
    with pytest.raises(ExportError, match="capserve export onnx"):
        build_engine(tmp_path / "bare.onnx", tmp_path / "m.plan")
    source = read_onnx(onnx_file, fp16=True)
    assert source.precision == "fp16" and source.input_shape == (3, 32, 32)
    assert source.outputs == ("logits", "class_poses")  # the class capsules travel into the engine


# --- the builder's and runtime's TensorRT calls, against a stand-in module ------------------------------------


def test_a_failed_engine_build_keeps_the_engine_that_was_there(tmp_path, onnx_file, monkeypatch):
    """A build killed (here: a full disk) while the engine goes out leaves the engine and sidecar there before it."""
    import pathlib

    import capserve.export.tensorrt as export_trt

    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt())
    monkeypatch.setattr(export_trt, "gpu_name", lambda device="cuda": "NVIDIA H200")
    engine = build_engine(onnx_file, tmp_path / "model.plan")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    real_write = pathlib.Path.write_bytes

    def dies_half_way(self, data):
        real_write(self, data[: len(data) // 2])
        raise OSError("No space left on device")

    monkeypatch.setattr(pathlib.Path, "write_bytes", dies_half_way)
    with pytest.raises(OSError, match="No space left"):
        build_engine(onnx_file, engine)
    monkeypatch.setattr(pathlib.Path, "write_bytes", real_write)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_build_engine_calls(tmp_path, onnx_file, monkeypatch, caplog):
    import capserve.export.tensorrt as export_trt

    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt(cache_from=b"timing cache"))
    monkeypatch.setattr(export_trt, "gpu_name", lambda device="cuda": "NVIDIA H200")
    cache = tmp_path / "timing.cache"
    engine = build_engine(onnx_file, tmp_path / "model.plan", 2, 8, 64, timing_cache=cache)
    calls = sys.modules["tensorrt"].calls
    assert ("create_network", 0) in calls and ("clear_flag", "TF32") in calls
    assert ("profile", ("images", (2, 3, 32, 32), (8, 3, 32, 32), (64, 3, 32, 32))) in calls
    assert ("timing_cache_in", b"") in calls and cache.read_bytes() == b"timing cache"
    assert engine.read_bytes() == onnx_file.read_bytes()  # the stand-in's "engine" is the parsed graph
    sidecar = EngineSidecar.read(sidecar_path(engine))
    assert (sidecar.tensorrt_version, sidecar.gpu_name, sidecar.max_batch) == ("10.13.0", "NVIDIA H200", 64)
    assert sidecar.onnx_sha256 == __import__("hashlib").sha256(onnx_file.read_bytes()).hexdigest()
    assert sidecar.metadata == load_runtime(onnx_file).metadata and sidecar.precision == "fp32"

    build_engine(onnx_file, tmp_path / "half.plan", fp16=True, timing_cache=cache)  # strongly typed on TRT 10
    assert ("create_network", 2) in calls and ("timing_cache_in", b"timing cache") in calls
    assert EngineSidecar.read(sidecar_path(tmp_path / "half.plan")).precision == "fp16"

    assert "ignored" not in caplog.text
    cache.write_bytes(b"a cache from another GPU")  # TensorRT ignores a foreign cache: say so
    build_engine(onnx_file, tmp_path / "again.plan", timing_cache=cache)
    assert f"timing cache {cache} was made by another TensorRT version or GPU" in caplog.text

    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt(parse_ok=False))
    with pytest.raises(ExportError, match=r"node 7 'node_MatMul_7' \(MatMul\): unsupported data type"):
        build_engine(onnx_file, tmp_path / "bad.plan")


@pytest.fixture
def stand_in_engine(tmp_path, onnx_file, monkeypatch):
    """An engine built and loaded through the strict stand-ins (batch profile 1..16)."""
    import capserve.export.tensorrt as export_trt

    trt = fake_tensorrt(profile=(1, 16))
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setattr(export_trt, "gpu_name", lambda device="cuda": "NVIDIA H200")
    strict_cuda(monkeypatch)
    return build_engine(onnx_file, tmp_path / "model.plan", 1, 8, 16), trt


def test_tensorrt_runtime_honours_the_api_contracts(stand_in_engine, runtime):
    engine, trt = stand_in_engine
    rt = load_runtime(engine, device="cuda")  # the README's and bentofile's value: the current device's index
    assert CURRENT_DEVICE["index"] == 0 and rt.providers == ["TensorRT:cuda:0"]
    for B in (1, 3, 16):
        x = np.random.default_rng(B).standard_normal((B, 3, 32, 32)).astype(np.float32)
        np.testing.assert_allclose(rt.predict(x), runtime.predict(x), atol=1e-5)
    with pytest.raises(InputError, match="optimisation profile"):
        rt.predict(np.zeros((17, 3, 32, 32), np.float32))
    load_runtime(engine, device="cuda:3")
    assert CURRENT_DEVICE["index"] == 3
    with pytest.raises(ValueError, match="cuda:N"):
        load_runtime(engine, device="cuda:x")
    assert trt.violations == []


def test_tensorrt_runtime_is_safe_under_concurrent_requests(stand_in_engine, runtime):
    """Server threads call one runtime at once; each must get its own batch's answer, and the context must never
    be used by two threads at a time (execute_async_v3 releases the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    engine, trt = stand_in_engine
    rt = load_runtime(engine, device="cuda")
    batches = [np.random.default_rng(i).standard_normal((1 + i % 5, 3, 32, 32)).astype(np.float32) for i in range(24)]
    expected = [runtime.predict(x) for x in batches]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(rt.predict, batches))
    assert trt.violations == []
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g, e, atol=1e-5)


def test_runtime_refuses_a_mismatched_engine_before_deserialising(tmp_path, monkeypatch):
    import capserve.runtime.tensorrt_backend as backend

    trt = fake_tensorrt()
    trt.__version__ = "10.14.1"
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setattr(backend, "gpu_name", lambda device="cuda": "NVIDIA H200")
    engine = tmp_path / "model.plan"
    engine.write_bytes(b"engine bytes")
    sidecar_path(engine).write_text(sidecar_for(b"engine bytes").to_json())
    with pytest.raises(RuntimeLoadError, match="rebuild it here with `capserve export tensorrt"):
        load_runtime(engine, device="cuda")
    sidecar_path(engine).write_text(dataclasses.replace(sidecar_for(b"engine bytes"), gpu_name="NVIDIA L4").to_json())
    trt.__version__ = "10.13.0"
    with pytest.raises(RuntimeLoadError, match="built for 'NVIDIA L4'"):
        load_runtime(engine, device="cuda")


def test_tensorrt_cli_reports_missing_tensorrt(onnx_file, tmp_path, capsys):
    from capserve.cli import main

    rc = main(
        ["export", "tensorrt", str(onnx_file), "-o", str(tmp_path / "m.plan"), "--min-batch", "9", "--opt-batch", "4"]
    )
    assert rc == 2 and "--min-batch <= --opt-batch" in capsys.readouterr().err
    if not HAS_TENSORRT:
        assert main(["export", "tensorrt", str(onnx_file), "-o", str(tmp_path / "m.plan")]) == 2
        assert TENSORRT_MISSING in capsys.readouterr().err


# --- the real thing --------------------------------------------------------------------------------------------


NEEDS = (("TensorRT is not installed", HAS_TENSORRT), ("no CUDA GPU", torch.cuda.is_available()))
MISSING = [what for what, ok in NEEDS if not ok]


@pytest.mark.skipif(bool(MISSING), reason=" and ".join(MISSING) + " (TensorRT engines need both)")
def test_tensorrt_engine_matches_eager(model, onnx_file, tmp_path):
    engine = build_engine(onnx_file, tmp_path / "model.plan", 1, 4, 8, timing_cache=tmp_path / "cache")
    runtime = load_runtime(engine, device="cuda")
    for B in (1, 3, 8):
        x = tiny_input(model, B)
        with torch.no_grad():
            expected = model(x, iterations=2).numpy()
        got = runtime.predict(x.numpy())
        assert np.abs(got - expected).max() <= 1e-3
        assert (got.argmax(1) == expected.argmax(1)).all()
    with pytest.raises(InputError, match="optimisation profile"):
        runtime.predict(np.zeros((9, 3, 32, 32), np.float32))
    sidecar = EngineSidecar.read(sidecar_path(engine))
    sidecar_path(engine).write_text(dataclasses.replace(sidecar, gpu_name="another GPU").to_json())
    with pytest.raises(RuntimeLoadError, match="built for 'another GPU'"):
        load_runtime(engine, device="cuda")


def test_torch_runtime_bf16_autocast_is_close_and_fp32_is_exact(tmp_path):
    model = tiny_model("cifar10-resnet").cpu()
    model.save(tmp_path / "m")
    x = tiny_input(model, 4).cpu().numpy()
    with torch.no_grad():
        expected = model(torch.from_numpy(x)).numpy()
    np.testing.assert_array_equal(load_runtime(tmp_path / "m").predict(x), expected)
    bf16 = load_runtime(tmp_path / "m", precision="bf16").predict(x)
    assert bf16.dtype == np.float32 and bf16.shape == expected.shape
    assert 0 < np.abs(bf16 - expected).max() < 0.1  # autocast really ran, and stays close
    with pytest.raises(ValueError, match="precision"):
        load_runtime(tmp_path / "m", precision="int3")


def test_torch_runtime_with_threads_runs_each_call_on_its_threads_whichever_thread_calls(tmp_path):
    """A server runs batches on one thread each beside lone requests on every core, from whichever worker thread
    takes them: torch keeps the count per calling thread, so each call sets its own, and gives the caller's back
    (a training run in the same process keeps its threads, and with them its bit-exact sums)."""
    model = tiny_model("cifar10-resnet").cpu()
    model.save(tmp_path / "m")
    runtime = load_runtime(tmp_path / "m")
    x = tiny_input(model, 4).cpu().numpy()
    seen: list[int] = []
    runtime.model.backbone.register_forward_pre_hook(lambda *_: seen.append(torch.get_num_threads()))
    one, two = runtime.with_threads(1), runtime.with_threads(2)
    assert one.model is runtime.model and two.model is runtime.model  # the weights are shared, not copied

    after: list[int] = []

    def calls() -> None:
        torch.set_num_threads(2)
        one.predict(x)
        two.infer(x)
        one.infer(x)
        after.append(torch.get_num_threads())

    caller = threading.Thread(target=calls)
    caller.start()
    caller.join()
    assert seen == [1, 2, 1]
    assert after == [2]  # the caller's own count, back after each call
    np.testing.assert_array_equal(one.predict(x), two.predict(x))


def test_torch_batches_at_once_on_one_thread_each_answer_as_one_at_a_time(tmp_path):
    model = tiny_model("cifar10-resnet").cpu()
    model.save(tmp_path / "m")
    runtime = load_runtime(tmp_path / "m").with_threads(1)
    batches = [tiny_input(model, 8, seed=seed).cpu().numpy() for seed in range(4)]
    expected = [runtime.predict(b) for b in batches]
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(runtime.predict, batches * 3))
    for got, want in zip(answers, expected * 3, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
