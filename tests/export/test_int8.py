"""INT8 export (``capserve.export.int8``): calibration on the user's images, the agreement gate, the sensitivity
search, metadata, verify, serving and the TensorRT build.

The shipped cifar10 model is quantized from its own ``models/cifar10/model.onnx`` (no tracing), calibrated on a few
of the committed real images: one module-scoped export serves most tests. What int8 measures depends on the CPU's
int8 kernels (agreement, accuracy, speed): these tests assert what holds on any CPU, the figures compared with what
this machine re-measures; the decisions taken on measurements are tested on stand-in sessions (``support.int8``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

import onnx
from support import real_images
from support.gpu import fake_tensorrt
from support.int8 import KINDS, flip_every, graph_kind, stand_in_sessions
from support.server import start_server, stop, wait_ready

from capserve.cli import main
from capserve.configs import ModelConfig
from capserve.data.preprocess import normalize_images
from capserve.errors import ExportError, Int8GateError, RuntimeLoadError
from capserve.export.calibration import read_calibration
from capserve.export.gate import INT8_MAX_ACCURACY_LOSS
from capserve.export.gate import INT8_MIN_AGREEMENT as MIN_AGREEMENT
from capserve.export.int8 import INT8_KEY, export_int8, read_summary
from capserve.export.quantize import class_capsule_nodes, search_float_nodes, variants_for
from capserve.export.speed import MIN_SPEEDUP
from capserve.hardware import cpu_info
from capserve.runtime import load_runtime
from capserve.runtime.metadata import INT8_CHECK_KEY, Int8Check

ROOT = Path(__file__).resolve().parents[2]
CIFAR10 = ROOT / "models" / "cifar10"


def write_folder(root: Path, split: str, images: np.ndarray, classes: np.ndarray, labels) -> None:
    for k, (image, c) in enumerate(zip(images, classes, strict=True)):
        folder = root / split / labels[c]
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image.transpose(1, 2, 0)).save(folder / f"{k:03d}.png")


@pytest.fixture(scope="module")
def config() -> ModelConfig:
    return ModelConfig.from_dict(json.loads((CIFAR10 / "config.json").read_text())["config"])


@pytest.fixture(scope="module")
def data(tmp_path_factory, config) -> Path:
    """``capserve train --data`` layout: train/ (100 fixture images) and test/ (the other 100)."""
    root = tmp_path_factory.mktemp("data")
    images, classes = real_images.cifar10()
    write_folder(root, "train", images[:100], classes[:100], config.labels)
    write_folder(root, "test", images[100:], classes[100:], config.labels)
    return root


@pytest.fixture(scope="module")
def int8_file(tmp_path_factory, data) -> tuple[Path, object]:
    """Written whatever this CPU's int8 kernels measure (``force``, ``keep_slow``): the gates are tested elsewhere."""
    out = tmp_path_factory.mktemp("int8") / "model.onnx"  # a folder of its own, served as CAPSERVE_MODEL
    return export_int8(CIFAR10, out, data, images=32, force=True, keep_slow=True)


def test_calibration_reads_the_users_images_through_the_service_preprocessing(data, config):
    images, classes = real_images.cifar10()
    cal = read_calibration(data, config, count=30)
    # every calibration image is one of the training images, normalised as the service does; each class its share
    train = normalize_images(images[:100], config)  # (100, C, H, W)
    match = [int(np.flatnonzero(np.abs(train - x).reshape(100, -1).max(1) < 1e-6)[0]) for x in cal.images]
    assert cal.images.shape == (30, 3, 32, 32) and cal.images.dtype == np.float32 and cal.stratified
    share = 30 * np.bincount(classes[:100], minlength=10) / 100
    assert len(set(match)) == 30 and np.abs(np.bincount(classes[match], minlength=10) - share).max() <= 1
    # the gate holds out the test split, with its labels
    assert cal.split == "test" and cal.held_out.shape == (100, 3, 32, 32)
    order = 100 + np.array(sorted(range(100), key=lambda k: (config.labels[classes[100 + k]], k)))  # scan order
    np.testing.assert_allclose(cal.held_out, normalize_images(images[order], config), atol=1e-6)
    np.testing.assert_array_equal(cal.targets, classes[order])

    # a CSV, and data without a test split: the training images calibration left are held out
    csv = data / "manifest.csv"
    rows = [f"train/{p.parent.name}/{p.name},{p.parent.name}" for p in sorted((data / "train").rglob("*.png"))]
    csv.write_text("image,labels\n" + "\n".join(rows) + "\n")
    cal = read_calibration(csv, config, count=40)
    assert len(cal.images) == 40 and len(cal.held_out) == 60 and cal.split.startswith("train images not used")
    with pytest.raises(ExportError, match="does not exist"):
        read_calibration(data / "missing", config)


def test_int8_export_agrees_with_fp32_and_keeps_the_metadata(int8_file):
    path, report = int8_file
    assert report.check.images == 100 and report.metric == "top-1" and report.lost is not None
    fp32, int8 = load_runtime(CIFAR10 / "model.onnx"), load_runtime(path)
    assert int8.precision == "int8" and int8.metadata == fp32.metadata
    images, classes = real_images.cifar10()
    x = normalize_images(images[100:], fp32.metadata)
    a, b = fp32.predict(x), int8.predict(x)  # (100, C): the gate's held-out images, re-measured here
    assert (a.argmax(1) == b.argmax(1)).mean() == report.check.agreement
    assert (a.argmax(1) == classes[100:]).mean() == report.fp32_accuracy
    assert (b.argmax(1) == classes[100:]).mean() == report.int8_accuracy
    proto = onnx.load(str(path))
    ops = {n.op_type for n in proto.graph.node}
    assert {"QuantizeLinear", "DequantizeLinear", "LayerNormalization", "Softmax"} <= ops
    summary = read_summary(path)
    assert (summary.calibration_images, summary.gate_split, summary.forced) == (32, "test", not report.passed)
    assert (summary.fp32_accuracy, summary.int8_accuracy) == (report.fp32_accuracy, report.int8_accuracy)
    assert summary.max_accuracy_loss == INT8_MAX_ACCURACY_LOSS and summary.cpu == cpu_info().to_dict()
    assert summary.speedup == pytest.approx(summary.int8_images_per_s / summary.fp32_images_per_s)
    assert summary.variant in variants_for(cpu_info()) and summary.kept_slow == (summary.speedup < MIN_SPEEDUP)
    # the routing's products of two activations (votes × poses) stay float: as MatMuls without a weight, or
    # exported as Mul and ReduceSum, which are never quantized
    activation_products = [n for n in summary.float_nodes if n not in summary.kept_float]
    assert all("Conv" not in n for n in activation_products)
    assert activation_products or {"Mul", "ReduceSum"} <= ops
    assert json.loads({p.key: p.value for p in proto.metadata_props}[INT8_KEY])["agreement"] == report.check.agreement


def test_the_int8_graph_returns_the_class_capsules_its_calibration_reads(int8_file):
    """The read-out of the class capsules stays in float, so that no quantize-dequantize pair rounds the capsules the
    int8 graph returns: its unfamiliarity answers as fp32's do on the real images (``capserve.runtime.familiarity``,
    the shipped model's calibration)."""
    from capserve.runtime.familiarity import read_familiarity
    from capserve.runtime.metadata import CLASS_POSES

    path, _ = int8_file
    proto = onnx.load(str(path))
    readout = class_capsule_nodes(onnx.load(str(CIFAR10 / "model.onnx")))
    assert readout and set(readout) <= set(read_summary(path).kept_float)
    assert not [n.name for n in proto.graph.node if n.op_type == "QuantizeLinear" and CLASS_POSES in n.input]
    fp32, int8 = load_runtime(CIFAR10 / "model.onnx"), load_runtime(path)
    familiarity = read_familiarity(CIFAR10)
    x = normalize_images(real_images.cifar10()[0], fp32.metadata)
    a, b = (familiarity.scores(runtime.infer(x)[1]) for runtime in (fp32, int8))
    assert np.median(np.abs(a - b) / a) < 0.1 and np.mean((a > 1) == (b > 1)) >= 0.9  # 32 calibration images


def test_the_gate_refuses_a_quantization_calibrated_on_blank_images(tmp_path, config, capsys):
    blank = tmp_path / "blank"
    images, classes = real_images.cifar10()
    write_folder(blank, "train", np.full((20, 3, 32, 32), 128, np.uint8), np.arange(20) % 10, config.labels)
    write_folder(blank, "test", images[100:], classes[100:], config.labels)  # real images to be judged on
    out = tmp_path / "bad.onnx"
    with pytest.raises(Int8GateError, match="not written: int8 vs fp32 top-1 agreement") as e:
        export_int8(CIFAR10, out, blank, images=10)
    assert not out.exists() and "--force" in str(e.value)
    # int8 holds on the blank images it was calibrated on and fails on real ones: the calibration is named first
    causes = str(e.value).split("Likelier causes, in order:")[1]
    assert causes.strip().startswith("(1) the calibration images (10 of --calibration"), causes
    assert (
        main(
            [
                "export",
                "onnx",
                str(CIFAR10),
                "-o",
                str(out),
                "--int8",
                "--calibration",
                str(blank),
                "--calibration-images",
                "10",
                "--force",
                "--keep-slow",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "written with --force below the bound 0.97" in printed and read_summary(out).forced
    assert read_summary(out).agreement < MIN_AGREEMENT


def test_the_search_leaves_the_most_sensitive_nodes_in_float():
    # agreement as a function of the float set: "b" matters most, then "c"; "a" never helps
    gain = {"a": 0.0, "b": 0.03, "c": 0.01}
    calls = []

    def agreement_with(nodes: list[str]) -> float:
        calls.append(tuple(nodes))
        return 0.95 + sum(gain[n] for n in nodes)

    chosen, reached, steps = search_float_nodes(["a", "b", "c"], agreement_with, bound=0.97)
    assert chosen == ["b"] and reached == pytest.approx(0.98) and [s.node for s in steps] == ["b"]
    chosen, reached, _ = search_float_nodes(["a", "b", "c"], agreement_with, bound=0.985)
    assert chosen == ["b", "c"] and reached == pytest.approx(0.99)
    assert search_float_nodes(["a", "b", "c"], agreement_with, bound=0.985, max_nodes=1)[0] == ["b"]
    # nothing left that helps: stop rather than give up speed for nothing
    assert search_float_nodes(["a", "b", "c"], agreement_with, bound=1.0)[0] == ["b", "c"]
    calls.clear()
    assert search_float_nodes(["a", "b"], agreement_with, bound=0.9, start=["c"])[0] == ["c"] and calls == [("c",)]


def test_keep_float_names_the_nodes_it_can_take(tmp_path, data, capsys):
    out = tmp_path / "m.onnx"
    args = ["export", "onnx", str(CIFAR10), "-o", str(out), "--int8", "--calibration", str(data)]
    assert main([*args, "--calibration-images", "8", "--keep-float", "node_nope"]) == 2
    err = capsys.readouterr().err
    assert "--keep-float node_nope: no such Conv/MatMul/Gemm node" in err and "node_Conv_" in err and not out.exists()
    assert main(["export", "onnx", str(CIFAR10), "-o", str(out), "--int8"]) == 2
    assert "--int8 needs --calibration DATA" in capsys.readouterr().err


def test_verify_int8_repeats_the_gate(int8_file, capsys):
    path, report = int8_file
    assert main(["verify", str(path), "--int8", "--against", str(CIFAR10)]) == (0 if report.passed else 1)
    out = capsys.readouterr().out
    assert f"agreement {report.check.agreement:.4f} on 100 held-out images (test" in out and str(report) in out
    assert main(["verify", str(path), "--int8", "--against", str(CIFAR10), "--min-agreement", "1.01"]) == 1
    assert main(["verify", str(CIFAR10 / "model.onnx"), "--int8", "--against", str(CIFAR10)]) == 2
    assert "is not an int8 export" in capsys.readouterr().err


# --- where it is served: the start-up re-check on the inputs the file records ---------------------------------


def test_an_int8_graph_verifies_itself_where_it_is_opened(int8_file):
    """The file records calibration images on which int8 decided as fp32 here, with both logits: opened on the
    machine that exported it, every decision holds and the logits are those recorded."""
    path, _ = int8_file
    record = read_check(path)
    n = record.shape[0]
    assert 1 <= n <= 32 and record.shape[1:] == (3, 32, 32) and record.bound == MIN_AGREEMENT
    assert record.cpu == cpu_info().describe()
    train, _ = real_images.cifar10()
    assert all((train[:100] == image).all(axis=(1, 2, 3)).any() for image in record.images())  # calibration images
    runtime = load_runtime(path)
    assert runtime.precision_reason.startswith(
        f"int8 verified on this machine: int8 decides as fp32 on 1.0000 of the {n} images its export recorded"
    )
    assert "max |Δlogit| 0 from the int8 logits of the exporting machine" in runtime.precision_reason


def test_an_int8_graph_is_refused_where_its_kernels_decide_otherwise(int8_file, monkeypatch, capsys):
    """On a CPU whose int8 kernels flip every 10th recorded image, the graph is refused with what was measured; one
    whose kernels move every logit alike, no decision changing, serves it and says by how much they moved."""
    path, _ = int8_file
    n = read_check(path).shape[0]
    flips = len(range(0, n, 10))
    stand_in_sessions(monkeypatch, change=dict.fromkeys(KINDS[1:], flip_every(10)))
    with pytest.raises(RuntimeLoadError, match="is not served on this CPU") as e:
        load_runtime(path)
    assert f"int8 decides as fp32 on {(n - flips) / n:.4f} of the {n} images its export recorded (bound 0.97" in str(
        e.value
    )
    assert "re-export it on this machine (`capserve export onnx MODEL_DIR -o model.onnx --int8" in str(e.value)
    # `capserve verify --int8` measures instead of refusing
    assert main(["verify", str(path), "--int8", "--against", str(CIFAR10)]) in (0, 1)
    assert "held-out images (test" in capsys.readouterr().out

    monkeypatch.undo()
    stand_in_sessions(monkeypatch, change=dict.fromkeys(KINDS[1:], lambda logits: logits + 0.25))
    assert "max |Δlogit| 0.25 from" in load_runtime(path).precision_reason


def test_an_int8_graph_without_the_inputs_to_recheck_is_refused(int8_file, tmp_path):
    path, _ = int8_file
    proto = onnx.load(str(path))
    kept = [(p.key, p.value) for p in proto.metadata_props if p.key != INT8_CHECK_KEY]
    del proto.metadata_props[:]
    for key, value in kept:
        proto.metadata_props.add(key=key, value=value)
    older = tmp_path / "older.onnx"
    onnx.save_model(proto, str(older))
    with pytest.raises(RuntimeLoadError, match="is an int8 graph without the inputs it re-checks on the machine"):
        load_runtime(older)


def read_check(path: Path) -> Int8Check:
    return Int8Check.from_json({p.key: p.value for p in onnx.load(str(path)).metadata_props}[INT8_CHECK_KEY])


# --- serving: CAPSERVE_MODEL at the int8 file, the real server -----------------------------------------------


@pytest.mark.slow
def test_the_served_int8_graph_answers_like_load_runtime(int8_file, tmp_path):
    path, _ = int8_file
    proc, url, log = start_server(tmp_path, CAPSERVE_MODEL=str(path), CAPSERVE_MULTILABEL_MODEL="none")
    try:
        wait_ready(proc, url, log)
        described = httpx.get(f"{url}/model", timeout=60).json()
        assert described["single_label"]["precision"] == "int8", described  # GET /model names no host path
        assert (
            "int8 verified on this machine: int8 decides as fp32 on 1.0000 of the"
            in (described["single_label"]["precision_reason"])
        )
        images, _ = real_images.cifar10()
        runtime = load_runtime(path)
        for image in images[100:104]:
            r = httpx.post(
                f"{url}/classify",
                files={"image": ("x.png", real_images.png(image), "image/png")},
                data={"top_k": "10"},
                timeout=60,
            )
            assert r.status_code == 200, r.text
            got = np.zeros(10)
            for p in r.json()["predictions"]:
                got[p["index"]] = p["probability"]
            logits = runtime.predict(normalize_images(image[None], runtime.metadata))[0]
            expected = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
            np.testing.assert_allclose(got, expected, atol=1e-4)
    finally:
        stop(proc)


# --- TensorRT: explicit quantization from the QDQ graph, against a strict stand-in -----------------------------


def test_tensorrt_int8_builds_from_the_qdq_graph(tmp_path, data, int8_file, monkeypatch):
    """The graph is exported with --force: how well ONNX Runtime's CPU kernels agree with fp32 on a TensorRT graph
    depends on the CPU (an AVX2-only one measured 0.960), and is not what TensorRT will compute. The export runs
    on sessions that flip one image in 25, as such a CPU does, so that no CPU passes this test by its kernels."""
    import capserve.export.tensorrt as export_trt
    from capserve.runtime.tensorrt_backend import EngineSidecar, sidecar_path

    monkeypatch.setattr(export_trt, "gpu_name", lambda device="cuda": "NVIDIA H200")
    trt = fake_tensorrt()
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    cpu_graph, _ = int8_file
    with pytest.raises(ExportError, match="re-export with `--int8 --int8-target tensorrt`"):
        export_trt.build_engine(cpu_graph, tmp_path / "m.plan", int8=True)  # uint8 activations
    with pytest.raises(ExportError, match="is a fp32 graph"):
        export_trt.build_engine(CIFAR10 / "model.onnx", tmp_path / "m.plan", int8=True)

    onnx_file = tmp_path / "model-trt.onnx"
    stand_in_sessions(monkeypatch, change=dict.fromkeys(KINDS[1:], flip_every(25)))
    assert (
        main(
            [
                "export",
                "onnx",
                str(CIFAR10),
                "-o",
                str(onnx_file),
                "--int8",
                "--calibration",
                str(data),
                "--calibration-images",
                "16",
                "--int8-target",
                "tensorrt",
                "--force",
            ]
        )
        == 0
    )
    assert graph_kind(onnx_file) == "s8s8" and read_summary(onnx_file).speedup is None  # not timed on a CPU
    assert main(["export", "tensorrt", str(onnx_file), "-o", str(tmp_path / "m.plan"), "--int8"]) == 0
    parsed = [c for c in trt.calls if c[0] == "parse"]
    assert parsed and parsed[0][1] > 0 and ("set_flag", "INT8") in trt.calls and ("create_network", 0) in trt.calls
    sidecar = EngineSidecar.read(sidecar_path(tmp_path / "m.plan"))
    assert sidecar.precision == "int8" and sidecar.metadata == load_runtime(CIFAR10 / "model.onnx").metadata

    trt11 = fake_tensorrt(version="11.0.0")  # strongly typed: precision from the Q/DQ layers, no flag
    monkeypatch.setitem(sys.modules, "tensorrt", trt11)
    export_trt.build_engine(onnx_file, tmp_path / "m11.plan")
    assert not [c for c in trt11.calls if c[0] == "set_flag"]
    assert EngineSidecar.read(sidecar_path(tmp_path / "m11.plan")).precision == "int8"
