"""INT8 decided where it runs: the export's speed gate (refused in one sentence below ``MIN_SPEEDUP`` unless
``--keep-slow``, nothing half-written), the variants tried on a CPU without int8 dot products (ONNX Runtime's
advice, the fastest that passes the gate kept), the accuracy a user loses gated beside agreement, and what the file
records of the machine it was gated on.

Every measured decision here runs on stand-in sessions (``support.int8``): real ONNX Runtime sessions whose time per
image and int8 logits the test sets (int8 answering with the fp32 graph's logits), so nothing depends on this CPU's
int8 kernels or its speed."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

from support import real_images
from support.int8 import FakeClock, flip_every, graph_kind, stand_in_sessions, write_image_folder
from support.models import tiny_model

import capserve.export.cli as export_cli
from capserve.cli import main
from capserve.configs import ModelConfig
from capserve.errors import Int8GateError, Int8SpeedError
from capserve.export.gate import INT8_MAX_ACCURACY_LOSS, score_logits
from capserve.export.int8 import export_int8, read_summary
from capserve.export.onnx import export_onnx, load_checkpoint
from capserve.export.quantize import variants_for
from capserve.export.speed import MIN_SPEEDUP, SPEED_BATCH
from capserve.hardware import cpu_info
from capserve.runtime.metadata import ModelMetadata

ROOT = Path(__file__).resolve().parents[2]
CIFAR10 = ROOT / "models" / "cifar10"
AVX2 = cpu_info(features={"avx2", "fma"})  # an AVX2-only x86 CPU: no int8 dot products
VNNI = cpu_info(features={"avx2", "fma", "avx512f", "avx512_vnni"})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A tiny capsule network (random weights, 16×16 input) as a model directory with its fp32 graph, recorded as
    made from these weights (so that each export quantizes it instead of tracing the model again)."""
    directory = tmp_path_factory.mktemp("tiny") / "model"
    model = tiny_model("cifar10-resnet", image_size=16)
    model.save(directory)
    export_onnx(model, directory / "model.onnx", weights_digest=load_checkpoint(directory)[1])
    return directory


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """train/ (100 real CIFAR-10 images) and test/ (50 others)."""
    labels = ModelConfig.from_dict(json.loads((CIFAR10 / "config.json").read_text())["config"]).labels
    root = tmp_path_factory.mktemp("data")
    images, classes = real_images.cifar10()
    write_image_folder(root, "train", images[:100], classes[:100], labels)
    write_image_folder(root, "test", images[100:150], classes[100:150], labels)
    return root


def seconds(fp32: float, **int8: float) -> dict[str, float]:
    """Seconds per image by graph kind, from the speed-ups over fp32 of each int8 kind."""
    return {"fp32": fp32, **{kind.replace("_", "-"): fp32 / speedup for kind, speedup in int8.items()}}


# ------------------------------------------------------------------------------------------ which variants


def test_onnx_runtimes_advice_is_tried_on_cpus_without_int8_dot_products():
    assert variants_for(VNNI) == ("u8s8",)
    assert variants_for(AVX2) == ("u8s8", "u8s8-7bit", "s8s8")
    assert variants_for(AVX2, "tensorrt") == variants_for(VNNI, "tensorrt") == ("s8s8",)


# ------------------------------------------------------------------------------------------ the speed gate


def test_an_int8_graph_slower_than_fp32_is_refused_in_one_sentence(tiny, folder, tmp_path, monkeypatch, capsys):
    """int8 at 0.9x fp32 on the exporting machine: exit 2, one line that says so, the file there before untouched,
    no partial; ``--keep-slow`` writes it and records that it was kept slow."""
    clock = FakeClock()
    opened = stand_in_sessions(monkeypatch, clock, seconds(0.01, u8s8=0.9), answer_as=tiny / "model.onnx")
    monkeypatch.setattr(export_cli, "export_int8", functools.partial(export_int8, clock=clock, cpu=VNNI))
    out = tmp_path / "out" / "model.onnx"
    out.parent.mkdir()
    out.write_bytes(b"the file there before")
    args = ["export", "onnx", str(tiny), "-o", str(out), "--int8", "--calibration", str(folder)]
    assert main([*args, "--calibration-images", "16"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and ". " not in errors[0], errors  # one sentence
    assert "error: not written: int8 runs at 0.90x fp32 at batch 32 on this CPU (" in errors[0]
    assert errors[0].endswith("pass --keep-slow to write it anyway")
    assert out.read_bytes() == b"the file there before" and [p.name for p in out.parent.iterdir()] == ["model.onnx"]
    assert {s.runs.count(SPEED_BATCH) for s in opened if s.kind in ("fp32", "u8s8")} >= {8}  # warm-up + 7 rounds

    assert main([*args, "--calibration-images", "16", "--keep-slow"]) == 0
    printed = capsys.readouterr().out
    assert "warning: written with --keep-slow below 1.2x fp32" in printed and "u8s8" in printed
    summary = read_summary(out)
    assert summary.kept_slow and summary.speedup == pytest.approx(0.9) and summary.min_speedup == MIN_SPEEDUP
    assert summary.batch == SPEED_BATCH and summary.int8_images_per_s == pytest.approx(0.9 * summary.fp32_images_per_s)
    assert summary.cpu == VNNI.to_dict() and [v["variant"] for v in summary.variants] == ["u8s8"]


def test_the_speed_gate_passes_at_exactly_its_bound(tiny, folder, tmp_path, monkeypatch):
    clock = FakeClock()
    # 6/64 and 5/64 s per image: exact in binary, so fp32's time over int8's is exactly 1.2
    stand_in_sessions(monkeypatch, clock, {"fp32": 6 / 64, "u8s8": 5 / 64}, answer_as=tiny / "model.onnx")
    out = tmp_path / "at.onnx"
    export_int8(tiny, out, folder, images=16, clock=clock, cpu=VNNI)
    summary = read_summary(out)
    assert summary.speedup == MIN_SPEEDUP and not summary.kept_slow
    with pytest.raises(Int8SpeedError, match=r"runs at 1\.20x fp32 .* below the 1\.21x"):
        export_int8(tiny, tmp_path / "above.onnx", folder, images=16, clock=clock, cpu=VNNI, min_speedup=1.21)
    assert not (tmp_path / "above.onnx").exists()


def test_a_graph_gated_at_full_agreement_is_served_on_the_machine_that_exported_it(tiny, folder, tmp_path, monkeypatch):
    """``--min-agreement 1``: the graph records images on which int8 decided as fp32, so where it was exported its
    start-up re-check agrees on all of them, exactly its bound, and the graph is served."""
    from capserve.runtime import load_runtime

    clock = FakeClock()
    stand_in_sessions(monkeypatch, clock, {"fp32": 6 / 64, "u8s8": 4 / 64}, answer_as=tiny / "model.onnx")
    out = tmp_path / "full.onnx"
    export_int8(tiny, out, folder, images=16, clock=clock, cpu=VNNI, min_agreement=1.0)
    runtime = load_runtime(out)
    assert runtime.precision == "int8"
    assert runtime.precision_reason.startswith("int8 verified on this machine: int8 decides as fp32 on 1.0000")
    assert "(bound 1, its export gate's" in runtime.precision_reason


# ------------------------------------------------------------------------------------------ without VNNI


def test_without_int8_dot_products_the_fastest_variant_that_passes_the_gate_is_kept(
    tiny, folder, tmp_path, monkeypatch
):
    """On an AVX2-only CPU: u8s8 at 0.9x, 7-bit weights at 1.5x, s8s8 at 2x but deciding otherwise on every other
    image. The 7-bit graph is written (its weights within ±64), and the record says what each variant measured."""
    clock = FakeClock()
    stand_in_sessions(
        monkeypatch,
        clock,
        seconds(0.01, u8s8=0.9, u8s8_7bit=1.5, s8s8=2.0),
        change={"s8s8": flip_every(2)},
        answer_as=tiny / "model.onnx",
    )
    out = tmp_path / "m.onnx"
    _, report = export_int8(tiny, out, folder, images=16, clock=clock, cpu=AVX2)
    assert graph_kind(out) == "u8s8-7bit" and report.passed
    summary = read_summary(out)
    assert summary.variant == "u8s8-7bit" and summary.speedup == pytest.approx(1.5)
    assert summary.cpu["features"] == ["avx2", "fma"]
    rows = {v["variant"]: v for v in summary.variants}
    assert list(rows) == ["u8s8", "u8s8-7bit", "s8s8"]
    assert [rows[v]["passed"] for v in rows] == [True, True, False] and rows["s8s8"]["agreement"] == 0.5
    assert rows["u8s8"]["speedup"] == pytest.approx(0.9) and rows["s8s8"]["speedup"] is None  # failing: not timed


def test_without_int8_dot_products_a_refusal_names_the_variants_it_tried(tiny, folder, tmp_path, monkeypatch):
    clock = FakeClock()
    stand_in_sessions(
        monkeypatch, clock, seconds(0.01, u8s8=0.8, u8s8_7bit=1.1, s8s8=0.7), answer_as=tiny / "model.onnx"
    )
    with pytest.raises(Int8SpeedError) as e:
        export_int8(tiny, tmp_path / "m.onnx", folder, images=16, clock=clock, cpu=AVX2)
    text = str(e.value)
    assert (
        "runs at 1.10x fp32" in text and "the fastest of u8s8, u8s8-7bit, s8s8 that passed the gate: u8s8-7bit" in text
    )
    assert AVX2.describe() in text and not (tmp_path / "m.onnx").exists()


# ------------------------------------------------------------------------------------------ accuracy lost


def table(images: int, flipped: int, wrong_before: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, ModelMetadata]:
    """fp32 logits right on every image but the last ``wrong_before``; int8 swaps its top two on the first
    ``flipped`` images (right → wrong)."""
    meta = ModelMetadata(
        name="m", task="single_label", labels=tuple("abc"), in_channels=1, image_size=2, mean=(0.5,), std=(0.5,),
        iterations=None,
    )  # fmt: skip
    targets = np.arange(images) % 3
    fp32 = np.zeros((images, 3), np.float32)
    fp32[np.arange(images), targets] = 2.0
    fp32[np.arange(images), (targets + 1) % 3] = 1.0
    if wrong_before:
        fp32[-wrong_before:] = fp32[-wrong_before:][:, [1, 0, 2]]
    int8 = fp32.copy()
    rows, top = np.arange(flipped), targets[:flipped]
    int8[rows, top], int8[rows, (top + 1) % 3] = fp32[rows, (top + 1) % 3], fp32[rows, top]
    return fp32, int8, targets, meta


@pytest.mark.parametrize(
    ("images", "flipped", "passed"),
    [
        (1000, 5, True),  # 0.5 points: at the bound
        (1000, 6, False),  # 0.6 points lost at an agreement of 0.994
        (1000, 20, False),
        (100, 1, True),  # one image is 1 point on 100: the finest loss they can show
        (100, 2, False),
    ],
)
def test_the_gate_refuses_accuracy_lost_beyond_its_bound_whatever_the_agreement(images, flipped, passed):
    fp32, int8, targets, meta = table(images, flipped)
    report = score_logits(fp32, int8, meta, targets, "test", bound=0.97)
    assert report.check.passed and report.lost == pytest.approx(flipped / images)
    assert report.passed is passed and report.accuracy_passed is passed, report
    assert (
        f"{100 * flipped / images:.2f} points lost (bound {100 * max(INT8_MAX_ACCURACY_LOSS, 1 / images):.2f})"
        in str(report)
    )
    unlabelled = score_logits(fp32, int8, meta, None, "test", bound=0.97)
    assert unlabelled.lost is None and unlabelled.passed


def test_an_export_losing_points_at_a_passing_agreement_is_refused(folder, tmp_path, monkeypatch):
    """The shipped model, int8 deciding as fp32 but for two images of the fifty held out: agreement 0.96 passes a
    0.95 bound, the 4 points lost do not."""
    stand_in_sessions(monkeypatch, change={"u8s8": flip_every(25)}, answer_as=CIFAR10 / "model.onnx")
    with pytest.raises(Int8GateError, match=r"agreement 0\.9600 .* 4\.00 points lost \(bound 2\.00\)"):
        export_int8(CIFAR10, tmp_path / "m.onnx", folder, images=16, min_agreement=0.95, cpu=VNNI, max_float_nodes=0)
    assert not (tmp_path / "m.onnx").exists()


def test_the_inputs_a_graph_records_are_ones_it_decided_as_fp32_on(tiny):
    """The start-up check re-runs the recorded images where the graph is opened: were they images on which int8
    decided otherwise, the graph would refuse itself on the very machine that exported and gated it."""
    from capserve.data.preprocess import normalize_numpy
    from capserve.export.int8 import check_record
    from capserve.runtime import load_runtime
    from capserve.runtime.precision import agreement

    int8 = load_runtime(tiny / "model.onnx")  # stands in for the int8 graph: what it decides is all that counts
    meta = int8.metadata
    pixels = np.random.default_rng(0).integers(0, 256, (40, *meta.input_shape), dtype=np.uint8)
    images = normalize_numpy(pixels, meta.mean, meta.std)
    fp32 = flip_every(4)(int8.predict_in_batches(images, 100))  # fp32 decides otherwise on every 4th image
    record = check_record(int8, pixels, images, fp32, 0.97, AVX2)
    recorded = record.images()
    assert len(recorded) == 30
    assert not any((recorded == image).all(axis=(1, 2, 3)).any() for image in pixels[::4])
    assert agreement(np.asarray(record.fp32_logits), np.asarray(record.int8_logits), meta) == 1.0
