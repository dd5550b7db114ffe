"""INT8 export: an FP32 graph quantized by ONNX Runtime, calibrated on the user's images, and gated on held-out ones.

Steps, top to bottom:

1. **Calibration data** (``read_calibration``): ``--calibration DATA`` is a folder or CSV in ``capserve train
   --data`` layout (``capserve.data.own``), or a built-in dataset's folder (CIFAR pickles, MNIST IDX). Images are
   decoded and normalised exactly as training and the service do (``capserve.data.preprocess``). ``count`` images
   come from the training split, stratified by label for single-label data (``capserve.data.own.carve``); the
   gate's held-out images come from the data's test split, else its val split, else the training images calibration
   did not use (own data), or the validation split the model was trained without (built-in data).
2. **Quantization** (``Quantizer``): the FP32 graph is pre-processed (``quant_pre_process``: constant folding turns
   the capsule layers' reshaped weights into initializers, so their Conv/MatMul get per-channel int8 weights),
   calibrated once (min-max by default), then ``quantize_static`` writes a QDQ graph: per-channel symmetric int8
   weights, per-tensor activations (uint8 for ONNX Runtime on CPUs, symmetric int8 for TensorRT, which accepts
   nothing else). Conv, MatMul and Gemm are quantized; LayerNorms, softmax and the routing's products of two
   activations stay in float (``excluded_nodes``).
3. **Sensitivity search** (``keep_sensitive_in_float``): when INT8 agrees with FP32 below the bound on the
   calibration images, the most sensitive weighted nodes are left in float, one at a time (at most
   ``MAX_FLOAT_NODES``).
4. **Gate** (``score``): FP32 and INT8 graphs on the held-out images; top-1 (or label-set) agreement, and top-1
   (or exact-match) accuracy of both. At or above ``MIN_AGREEMENT`` it passes; below it the file is not written
   unless ``force``, and the refusal says what was measured (``diagnose``: fp32's margins, int8's logit error,
   agreement per class, on the calibration images too) and the likelier causes in that light, in order.

The file keeps capserve's metadata (``capserve.export.onnx.metadata_props``) with ``capserve.precision`` = ``int8``
and ``capserve.int8``: JSON with the calibration and gate summary (``Int8Summary``), which ``capserve verify --int8``
reads to repeat the gate.

What was measured (docs/int8.md has the tables and commands): on the shipped cifar10-resnet, min-max, percentile
and entropy calibration are within 3 of 2,000 test images of each other, so min-max (fastest to calibrate) is the
default. On the shipped multimnist-matrix-small, quantizing everything gives label-set agreement 0.960 (refused);
percentile calibration 0.966; leaving the routing's MatMuls in float changes nothing; leaving the one Conv that
computes the convolutional capsule layer's votes in float gives 0.979 at 2.3x fp32, and the search finds that node.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from capserve.configs import ModelConfig
from capserve.errors import ExportError, Int8GateError
from capserve.runtime.metadata import METADATA_KEY, PRECISION_KEY, ModelMetadata
from capserve.runtime.outputs import thresholds_or_default
from capserve.runtime.precision import AgreementReport, compare_precisions, decisions

from .onnx import read_metadata, set_metadata

log = logging.getLogger(__name__)

INT8_KEY = "capserve.int8"  # metadata_props key: the Int8Summary JSON
DEFAULT_IMAGES = 512  # calibration images
GATE_IMAGES = 1000  # held-out images the gate scores (at most)
# Least top-1 (label-set) agreement of INT8 with FP32 on held-out images. Measured on 1,000 validation images: the
# shipped cifar10-resnet agrees on 0.996 (top-1 94.5 -> 94.2 %); multimnist-matrix-small fully quantized on 0.960
# (exact match 87.9 -> 86.2 %, refused: 1.7 points lost), with its capsule-vote Conv in float (what the search
# picks) on 0.979 (87.9 -> 87.3 %); calibrated on blank images cifar10 falls far below it. One bound for both tasks:
# label-set agreement is stricter than top-1, and 0.97 already keeps the loss under a point on each.
MIN_AGREEMENT = 0.97
TARGETS = {"onnxruntime": "uint8 activations (x86 u8s8 kernels)", "tensorrt": "symmetric int8 activations"}
QUANTIZED_OPS = ("Conv", "MatMul", "Gemm")
METHODS = ("minmax", "percentile", "entropy")
# The most Conv/MatMul nodes the sensitivity search leaves in float (each costs speed; see keep_sensitive_in_float).
MAX_FLOAT_NODES = 3


# ------------------------------------------------------------------------------------------------ calibration data


@dataclass
class CalibrationSet:
    """Normalised images (N, C, H, W) float32 to calibrate on, and held-out images with targets for the gate."""

    images: np.ndarray  # (N, C, H, W)
    held_out: np.ndarray  # (M, C, H, W)
    targets: np.ndarray | None  # (M,) class indices, or (M, C) multi-hot; None when the held-out images have no labels
    source: str
    split: str  # where the held-out images came from
    stratified: bool


def _normalised(pixels: np.ndarray, spec: Any) -> np.ndarray:
    from capserve.data.preprocess import normalize_images

    return normalize_images(pixels, spec).astype(np.float32)  # (N, C, H, W)


def _decode(samples: Sequence[Any], config: ModelConfig, source: Path, desc: str) -> tuple[np.ndarray, list[int]]:
    """uint8 (N, C, H, W) of ``samples``, decoded as training and the service do; unreadable files skipped."""
    from capserve.data.own import FailureLog, iter_decoded

    failures = FailureLog(len(samples), source)
    parts, kept = [], []
    for images, index in iter_decoded(samples, config, failures, desc=desc):
        parts.append(images)
        kept += index
    failures.check()
    if not kept:
        raise ExportError(f"no readable images in {source} to {desc.split()[0]} on")
    return np.concatenate(parts), kept


def _own_data(path: Path, config: ModelConfig, count: int, gate_images: int) -> CalibrationSet:
    from capserve.data.own import carve, check_labels, scan, targets_for

    manifest = scan(path)
    check_labels(manifest, config.labels, "the model's labels", ("train", "val", "test"))
    train = manifest.splits["train"] or [s for split in manifest.splits.values() for s in split]
    stratified = manifest.task == "single_label" and all(len(s.labels) == 1 for s in train)
    count = min(count, len(train))
    try:
        rest, chosen = carve(train, count, stratified) if count < len(train) else ([], list(range(len(train))))
    except ValueError:  # a label with too few images to leave one behind: draw without strata
        stratified = False
        rest, chosen = carve(train, count, False)
    held, split = next(
        ((manifest.splits[s], s) for s in ("test", "val") if manifest.splits.get(s)),
        ([train[i] for i in rest], "train images not used for calibration"),
    )
    if len(held) > gate_images:  # a seeded draw, every label in its share: a folder's scan order is by label
        held_stratified = manifest.task == "single_label" and all(len(s.labels) == 1 for s in held)
        try:
            _, drawn = carve(held, gate_images, held_stratified)
        except ValueError:
            _, drawn = carve(held, gate_images, False)
        held = [held[i] for i in sorted(drawn)]
    calibration, _ = _decode([train[i] for i in chosen], config, manifest.source, "calibration images")
    targets = None
    held_out = np.zeros((0, *calibration.shape[1:]), np.uint8)
    if held:
        held_out, kept = _decode(held, config, manifest.source, "held-out images")
        labelled = all(s.labels for s in held) or config.task == "multi_label"
        if labelled:
            targets = targets_for([held[i] for i in kept], config.labels, config.task == "multi_label").numpy()
    return CalibrationSet(
        _normalised(calibration, config), _normalised(held_out, config), targets, str(path), split, stratified
    )


def _builtin(path: Path, config: ModelConfig, count: int, gate_images: int) -> CalibrationSet:
    """CIFAR-10/100 or DiverseMultiMNIST from its own files: calibration from the training part, the gate on the
    validation split the model's training carved (``val_size`` recorded in its config; 5,000 by default)."""
    import torch

    from capserve.data import dataset_for, load_training, multimnist

    dataset = config.extra.get("data", {}).get("dataset") or dataset_for(config.labels, config.task, config.image_size)
    val_size = config.extra.get("data", {}).get("val_size") or 5000
    data = load_training(dataset, path, val_size=val_size)
    g = torch.Generator().manual_seed(0)
    if data.train is not None:  # CIFAR: stratified draw
        targets = data.train.targets.numpy()
        rng = np.random.default_rng(0)
        per_class = [rng.permutation(np.flatnonzero(targets == c)) for c in range(config.num_classes)]
        order = np.concatenate(per_class)[
            np.argsort(np.concatenate([np.arange(len(p)) for p in per_class]), kind="stable")
        ]  # round-robin over the classes
        calibration, stratified = data.train.images[torch.from_numpy(order[:count])].numpy(), True
    else:  # DiverseMultiMNIST: images drawn from the training digits
        digits, labels = data.digits
        calibration, stratified = multimnist(digits, labels, count, g).images.numpy(), False
    held = data.val.subset(torch.arange(min(gate_images, len(data.val))))
    return CalibrationSet(
        _normalised(calibration, config),
        _normalised(held.images.numpy(), config),
        held.targets.numpy(),
        str(path),
        f"{dataset} validation split",
        stratified,
    )


def read_calibration(
    data: str | Path, config: ModelConfig, count: int = DEFAULT_IMAGES, gate_images: int = GATE_IMAGES
) -> CalibrationSet:
    """Calibration and held-out images for ``config``'s model from a folder/CSV (or a built-in dataset's folder)."""
    from capserve.data.own import is_own_data

    if count < 1:
        raise ExportError(f"--calibration-images must be >= 1, got {count}")
    path = Path(data)
    if not path.exists():
        raise ExportError(
            f"--calibration {path} does not exist: pass a folder of label folders or a CSV "
            "(`capserve train --data` layout)"
        )
    if is_own_data(path):
        return _own_data(path, config, count, gate_images)
    return _builtin(path, config, count, gate_images)


# ------------------------------------------------------------------------------------------------ quantization


def excluded_nodes(proto: Any) -> list[str]:
    """Conv/MatMul/Gemm nodes whose second operand is not a weight: the routing's agreement products between two
    activations (votes × poses), kept in float: both operands change per image and the per-tensor scale of a vote
    tensor covers every child and parent at once."""
    weights = {i.name for i in proto.graph.initializer}
    return [
        n.name
        for n in proto.graph.node
        if n.op_type in QUANTIZED_OPS and len(n.input) > 1 and n.input[1] not in weights
    ]


class _Reader:
    """``onnxruntime.quantization.CalibrationDataReader``: the calibration images in batches."""

    def __init__(self, name: str, images: np.ndarray, batch_size: int = 32):
        self.batches = iter([{name: images[i : i + batch_size]} for i in range(0, len(images), batch_size)])

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self.batches, None)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self.batches


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """ONNX Runtime's quantization tools log through the root logger (advice, per-op notes): keep them at errors."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(max(level, logging.ERROR))
    try:
        yield
    finally:
        root.setLevel(level)


class Quantizer:
    """One FP32 graph, pre-processed and calibrated once; ``build`` makes its QDQ INT8 graph with any set of
    Conv/MatMul/Gemm nodes left in float (ONNX Runtime's calibration cache makes each build a few seconds).

    ``target``: ``onnxruntime`` (uint8 activations, the fast CPU kernels) or ``tensorrt`` (symmetric int8
    activations, zero points 0, as TensorRT's explicit quantization requires). Use it as a context manager (it keeps
    its working files in a temporary folder).
    """

    def __init__(
        self,
        fp32: Any,
        images: np.ndarray,
        target: str = "onnxruntime",
        method: str = "minmax",
        percentile: float = 99.999,
    ):
        import onnx
        from onnxruntime.quantization.shape_inference import quant_pre_process

        if target not in TARGETS:
            raise ExportError(f"int8 target {target!r}; choose one of: {', '.join(TARGETS)}")
        if method not in METHODS:
            raise ExportError(f"calibration method {method!r}; choose one of: {', '.join(METHODS)}")
        self.fp32, self.images, self.target, self.method, self.percentile = fp32, images, target, method, percentile
        self._tmp = tempfile.TemporaryDirectory(prefix="capserve-int8-")
        tmp = Path(self._tmp.name)
        self._pre, self._cache = tmp / "pre.onnx", tmp / "calibration.json"
        onnx.save_model(fp32, str(tmp / "fp32.onnx"))
        with _quiet():
            quant_pre_process(str(tmp / "fp32.onnx"), str(self._pre), skip_symbolic_shape=True)
        pre = onnx.load(str(self._pre))
        self.activation_products = excluded_nodes(pre)  # always float
        weights = {i.name for i in pre.graph.initializer}
        # what may be quantized: Conv/MatMul/Gemm with a weight operand, in graph order
        self.weighted = [
            n.name for n in pre.graph.node if n.op_type in QUANTIZED_OPS and len(n.input) > 1 and n.input[1] in weights
        ]

    def __enter__(self) -> Quantizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self._tmp.cleanup()

    def build(self, keep_float: Sequence[str] = ()) -> Any:
        """The QDQ graph with ``keep_float`` (node names, see ``weighted``) and the activation products in float."""
        import onnx
        from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

        unknown = sorted(set(keep_float) - set(self.weighted))
        if unknown:
            raise ExportError(
                f"--keep-float {', '.join(unknown)}: no such Conv/MatMul/Gemm node with weights; "
                f"the graph's are: {', '.join(self.weighted)}"
            )
        calibrate = {
            "minmax": CalibrationMethod.MinMax,
            "percentile": CalibrationMethod.Percentile,
            "entropy": CalibrationMethod.Entropy,
        }[self.method]
        symmetric = self.target == "tensorrt"
        out = Path(self._tmp.name) / "int8.onnx"
        with _quiet():
            quantize_static(
                str(self._pre),
                str(out),
                _Reader(self.fp32.graph.input[0].name, self.images),
                quant_format=QuantFormat.QDQ,
                per_channel=True,
                activation_type=QuantType.QInt8 if symmetric else QuantType.QUInt8,
                weight_type=QuantType.QInt8,
                op_types_to_quantize=list(QUANTIZED_OPS),
                nodes_to_exclude=self.activation_products + list(keep_float),
                calibrate_method=calibrate,
                calibration_cache_path=str(self._cache),
                # TensorRT takes int8 Q/DQ only: biases stay float there (ONNX Runtime folds int32 biases in)
                extra_options={
                    "ActivationSymmetric": symmetric,
                    "WeightSymmetric": True,
                    "QuantizeBias": not symmetric,
                    "CalibPercentile": self.percentile,
                },
            )
        proto = onnx.load(str(out))
        set_metadata(proto, {**read_metadata(self.fp32), PRECISION_KEY: "int8"})
        proto.producer_name, proto.producer_version = self.fp32.producer_name, self.fp32.producer_version
        proto.doc_string = self.fp32.doc_string + " (int8 QDQ)"
        return proto


def quantize(
    fp32: Any,
    images: np.ndarray,
    target: str = "onnxruntime",
    method: str = "minmax",
    keep_float: Sequence[str] = (),
    percentile: float = 99.999,
) -> tuple[Any, list[str]]:
    """A QDQ INT8 ``onnx.ModelProto`` from an FP32 one, calibrated on normalised ``images`` (N, C, H, W), and the
    names of the Conv/MatMul nodes left in float (the activation products, then ``keep_float``). See ``Quantizer``.
    """
    with Quantizer(fp32, images, target, method, percentile) as q:
        return q.build(keep_float), q.activation_products + list(keep_float)


@dataclass(frozen=True)
class SearchStep:
    """One step of ``keep_sensitive_in_float``: the node it left in float and the agreement that reached."""

    node: str
    agreement: float


def search_float_nodes(
    candidates: Sequence[str],
    agreement_with: Callable[[list[str]], float],
    bound: float,
    max_nodes: int = MAX_FLOAT_NODES,
    start: Sequence[str] = (),
) -> tuple[list[str], float, list[SearchStep]]:
    """Greedy choice of the nodes to leave in float: while ``agreement_with(nodes)`` is below ``bound`` and fewer than
    ``max_nodes`` were added to ``start``, try each remaining candidate added in turn and keep the one that raises
    the agreement most (ties broken by name, so the search is deterministic); stop when none raises it.

    Returns the float nodes (``start`` first), the agreement they reach, and the steps taken.
    """
    chosen = list(start)
    current, steps = agreement_with(chosen), []
    while current < bound and len(steps) < max_nodes:
        trials = [(agreement_with([*chosen, n]), n) for n in candidates if n not in chosen]
        if not trials:
            break
        best, node = max(trials)
        if best <= current:  # no single node helps: more float would only cost speed
            break
        chosen.append(node)
        current = best
        steps.append(SearchStep(node, best))
        log.info("int8: %s left in float, agreement on the calibration images %.4f", node, best)
    return chosen, current, steps


def keep_sensitive_in_float(
    quantizer: Quantizer, fp32: Any, bound: float, max_nodes: int = MAX_FLOAT_NODES, keep_float: Sequence[str] = ()
) -> tuple[list[str], float, list[SearchStep]]:
    """``search_float_nodes`` over the quantizer's weighted nodes, scored by INT8-vs-FP32 agreement on the
    *calibration* images, not the held-out ones, so that the gate that follows is an unbiased check of the choice."""

    def agreement_with(nodes: list[str]) -> float:
        int8 = _session(quantizer.build(nodes))
        return compare_precisions(fp32, int8, quantizer.images, bound).agreement

    return search_float_nodes(quantizer.weighted, agreement_with, bound, max_nodes, keep_float)


def tensorrt_problems(proto: Any) -> list[str]:
    """What TensorRT's explicit quantization would reject in a QDQ graph: it takes signed int8 Q/DQ with zero point
    0 only (an ONNX Runtime-flavoured graph has uint8 activations). Empty when the graph is fine."""
    from onnx import TensorProto, numpy_helper

    values = {i.name: i for i in proto.graph.initializer}
    problems = []
    for node in proto.graph.node:
        if node.op_type not in ("QuantizeLinear", "DequantizeLinear") or len(node.input) < 3:
            continue
        zero = values.get(node.input[2])
        if zero is None:
            problems.append(f"{node.name}: zero point {node.input[2]!r} is not a constant")
        elif zero.data_type != TensorProto.INT8 or numpy_helper.to_array(zero).any():
            problems.append(f"{node.name}: zero point must be int8 0 (got {TensorProto.DataType.Name(zero.data_type)})")
    return problems


def check_tensorrt_int8(path: str | Path, data: bytes, precision: str, fp16: bool) -> None:
    """``capserve export tensorrt --int8``'s input: an INT8 QDQ graph TensorRT can take (``ExportError`` if not)."""
    import onnx

    if fp16:
        raise ExportError("--int8 and --fp16 exclude each other: the INT8 graph's Q/DQ layers set its precision")
    if precision != "int8":
        raise ExportError(
            f"{path} is a {precision} graph: TensorRT builds INT8 from Q/DQ layers (no implicit "
            f"calibration); export one first with `capserve export onnx MODEL_DIR -o {Path(path).stem}"
            "-int8.onnx --int8 --int8-target tensorrt --calibration DATA`"
        )
    problems = tensorrt_problems(onnx.load_model_from_string(data))
    if problems:
        shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
        raise ExportError(
            f"{path} has Q/DQ layers TensorRT rejects ({shown}): it was quantized for ONNX Runtime; "
            "re-export with `--int8 --int8-target tensorrt`"
        )


# ------------------------------------------------------------------------------------------------ the gate


@dataclass(frozen=True)
class GateReport:
    """INT8 against FP32 on held-out images: agreement (``AgreementReport``) and the accuracy of both."""

    check: AgreementReport
    metric: str  # "top-1" or "exact match"
    fp32_accuracy: float | None  # None without labels
    int8_accuracy: float | None
    split: str

    @property
    def passed(self) -> bool:
        return self.check.passed

    def __str__(self) -> str:
        c = self.check
        text = (
            f"int8 vs fp32 {c.measure} agreement {c.agreement:.4f} on {c.images} held-out images ({self.split}; "
            f"bound {c.bound:g}), max |Δlogit| {c.max_abs_logit:.3g}"
        )
        if self.fp32_accuracy is not None:
            text += f"; {self.metric} fp32 {self.fp32_accuracy:.2%}, int8 {self.int8_accuracy:.2%}"
        return text


def accuracy(logits: np.ndarray, targets: np.ndarray, metadata: ModelMetadata) -> float:
    """Top-1 (single-label) or exact match with the model's thresholds (multi-label) of logits (N, C)."""
    chosen = decisions(logits, metadata)  # (N, 1) or (N, C)
    truth = targets[:, None] if metadata.task != "multi_label" else targets > 0.5  # (N, 1) or (N, C)
    return float((chosen == truth).all(axis=1).mean())


def score(
    fp32: Any,
    int8: Any,
    held_out: np.ndarray,
    targets: np.ndarray | None,
    split: str,
    bound: float = MIN_AGREEMENT,
    batch_size: int = 100,
) -> GateReport:
    """The gate: two runtimes (``load_runtime`` of the FP32 and INT8 graphs) on held-out images (M, C, H, W)."""
    if not len(held_out):
        raise ExportError(
            "no held-out images to check the int8 graph on: give --calibration data with a test or "
            "val split, or more images than --calibration-images"
        )
    check = compare_precisions(fp32, int8, held_out, bound, batch_size)
    check = dataclasses.replace(check, candidate="int8", sample="held-out images")
    meta = fp32.metadata
    metric = "exact match" if meta.task == "multi_label" else "top-1"
    if targets is None:
        return GateReport(check, metric, None, None, split)
    chunks = range(0, len(held_out), batch_size)
    a = np.concatenate([fp32.predict(held_out[i : i + batch_size]) for i in chunks])  # (M, C)
    b = np.concatenate([int8.predict(held_out[i : i + batch_size]) for i in chunks])  # (M, C)
    return GateReport(check, metric, accuracy(a, targets, meta), accuracy(b, targets, meta), split)


def _logits(runtime: Any, images: np.ndarray, batch_size: int = 100) -> np.ndarray:
    """``runtime``'s logits (N, C) for normalised images (N, C, H, W), in batches."""
    return np.concatenate([runtime.predict(images[i : i + batch_size]) for i in range(0, len(images), batch_size)])


def decision_margins(logits: np.ndarray, metadata: ModelMetadata) -> np.ndarray:
    """How far each image (logits (N, C)) is from another decision, in logits: top-1 minus the runner-up
    (single-label), or the distance of the logit nearest its threshold's logit (multi-label). (N,)"""
    if metadata.task != "multi_label":
        top = np.sort(logits.astype(np.float64), axis=1)
        return top[:, -1] - top[:, -2] if logits.shape[1] > 1 else np.full(len(logits), np.inf)
    t = np.clip(thresholds_or_default(metadata.thresholds, logits.shape[1]), 1e-12, 1 - 1e-12)
    return np.abs(logits.astype(np.float64) - np.log(t / (1 - t))).min(axis=1)


# Per-class agreements named in a refusal (the lowest first)
SHOWN_CLASSES = 3


def diagnose(
    held_out: tuple[np.ndarray, np.ndarray],
    calibration: tuple[np.ndarray, np.ndarray],
    metadata: ModelMetadata,
    bound: float,
    calibration_data: str,
    max_float_nodes: int,
) -> str:
    """Why an INT8 graph failed the gate, from the (fp32, int8) logits (N, C) of the held-out and of the calibration
    images: what was measured, then the likelier causes in the order the measurements point to.

    int8's error on its own calibration images is its rounding where the calibrated ranges fit; fp32's margins set
    against it tell a model that decides by near-ties (weakly trained: any rounding flips them, no calibration
    helps) from a quantization that is too coarse, and the calibration images' own agreement tells whether int8
    fails only on images unlike those it was calibrated on."""
    multi = metadata.task == "multi_label"
    fp32, int8 = held_out

    def agree(a: np.ndarray, b: np.ndarray) -> np.ndarray:  # (N,): the same decision
        return (decisions(a, metadata) == decisions(b, metadata)).all(axis=1)

    def shift(a: np.ndarray, b: np.ndarray) -> np.ndarray:  # (N,): how far int8 moves each image's logits
        return np.abs(b.astype(np.float64) - a).max(axis=1)

    margins, same = decision_margins(fp32, metadata), agree(fp32, int8)  # (N,), (N,)
    agreement, calibration_agreement = float(same.mean()), float(agree(*calibration).mean())
    rounding = float(np.median(shift(*calibration)))
    reach = rounding * (1 if multi else 2)  # a flip of the top two moves both logits; a threshold decision one
    near = float((margins <= reach).mean())  # the held-out images int8's rounding alone can flip
    what = "the logit nearest its threshold" if multi else "top-1 minus runner-up logit"
    measured = (
        f"fp32's margins ({what}): median {np.median(margins):.3g} over the {len(margins)} held-out images"
        + (
            f", {np.median(margins[~same]):.3g} over the {int((~same).sum())} int8 decides otherwise"
            if (~same).any()
            else ""
        )
        + f"; on the calibration images int8 agrees on {calibration_agreement:.4f} and moves logits by "
        f"{rounding:.3g} (median of each image's max |Δlogit|; {np.median(shift(fp32, int8)):.3g} on the "
        f"held-out), within reach of another decision for {near:.0%} of the held-out images"
    )
    if multi:  # per label: that label's decision
        per = (decisions(int8, metadata) == decisions(fp32, metadata)).mean(axis=0)  # (C,)
        counts = np.full(len(per), len(fp32))
        title = "agreement per label, lowest"
    else:  # per class of fp32's answer
        answer = fp32.argmax(1)
        counts = np.bincount(answer, minlength=fp32.shape[1])
        per = np.array([same[answer == c].mean() if counts[c] else np.inf for c in range(fp32.shape[1])])
        title = "agreement per class of fp32's answer, lowest"
    order = [c for c in np.argsort(per, kind="stable") if np.isfinite(per[c])][:SHOWN_CLASSES]
    classes = ", ".join(f"{metadata.labels[c]} {per[c]:.2f} of {counts[c]}" for c in order)

    weak = (
        f"the model decides by small margins (weakly trained?): {near:.0%} of the held-out images sit within "
        "int8's rounding of another decision, and no calibration changes that; train it further, or lower "
        "--min-agreement / pass --force if this fp32 model is the one to serve"
    )
    covered = calibration_agreement >= bound  # int8 holds on the images it was calibrated on
    if covered:
        unlike = (
            f"the calibration images ({calibration_data}) do not cover the held-out ones: int8 agrees with "
            f"fp32 on {calibration_agreement:.4f} of them but on {agreement:.4f} of the held-out; calibrate on "
            "images like the served ones, or on more of them (--calibration-images)"
        )
    else:
        unlike = (
            f"the calibration images ({calibration_data}) may not look like the served ones (the least "
            f"likely: int8 disagrees on them too); calibrate on images like the served ones, or on more of "
            "them (--calibration-images)"
        )
    coarse = (
        f"some layers lose too much to int8 (it moves logits by up to {shift(fp32, int8).max():.3g}): leave "
        f"the most sensitive in float (--max-float-nodes, {max_float_nodes} this time; or --keep-float NODE), "
        "or try --calibration-method percentile"
    )
    if near >= 1 - bound:  # near-ties alone can account for failing the gate
        causes = [weak, *((unlike, coarse) if covered else (coarse, unlike))]
    else:
        causes = [unlike, coarse, weak] if covered else [coarse, unlike, weak]
    listed = "".join(f"\n  ({i}) {cause}" for i, cause in enumerate(causes, 1))
    return f"Measured: {measured}; {title}: {classes}.\nLikelier causes, in order:{listed}"


def _session(proto: Any) -> Any:
    """An ``OnnxRuntime`` for an in-memory graph (written to a temporary file: the runtime opens paths)."""
    import onnx

    from capserve.runtime.onnx_backend import OnnxRuntime

    with tempfile.TemporaryDirectory(prefix="capserve-int8-") as tmp:
        path = Path(tmp) / "model.onnx"
        onnx.save_model(proto, str(path))
        return OnnxRuntime(path, threads=0)


@dataclass(frozen=True)
class Int8Summary:
    """What ``capserve.int8`` records: how the graph was quantized and what the gate measured."""

    target: str
    method: str
    calibration: str  # the data's path, as given
    calibration_images: int
    stratified: bool
    quantized_ops: tuple[str, ...]
    float_nodes: tuple[str, ...]  # every Conv/MatMul/Gemm left in float (activation products, then kept_float)
    kept_float: tuple[str, ...]  # the weighted nodes left in float (--keep-float, then the search's)
    calibration_agreement: float  # on the calibration images, with kept_float in float
    gate_split: str
    gate_images: int
    agreement: float
    bound: float
    metric: str
    fp32_accuracy: float | None
    int8_accuracy: float | None
    forced: bool

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Int8Summary:
        data = json.loads(text)
        known = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(data, dict) or set(data) - known or known - set(data):
            raise ExportError(
                f"{INT8_KEY!r} is not a capserve int8 summary; re-export with `capserve export onnx --int8`"
            )
        return cls(
            **{
                **data,
                "quantized_ops": tuple(data["quantized_ops"]),
                "float_nodes": tuple(data["float_nodes"]),
                "kept_float": tuple(data["kept_float"]),
            }
        )


def fp32_graph(
    checkpoint: str | Path,
    model: Any,
    digest: str,
    iterations: int | None = None,
    opset: int | None = None,
    use: str = "to quantize",
) -> Any:
    """The FP32 ``onnx.ModelProto`` to quantize (or, ``use``, to compare against): the model directory's own
    ``model.onnx`` when it was exported from these weights at this T (and opset, if one is asked for), else a fresh
    export (tracing takes tens of seconds)."""
    import onnx

    from capserve.export.onnx import DEFAULT_OPSET, export_onnx
    from capserve.runtime.metadata import ModelMetadata

    T = iterations or (model.config.iterations if model.config.has_routing else None)  # a CNN has no T
    shipped = Path(checkpoint) / "model.onnx"
    if shipped.is_file():
        proto = onnx.load(str(shipped))
        props = read_metadata(proto)
        version = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), None)
        try:
            meta = ModelMetadata.from_json(props.get(METADATA_KEY, ""))
        except (ValueError, TypeError):
            meta = None
        if (
            meta is not None
            and meta.weights_sha256 == digest
            and meta.iterations == T
            and props.get(PRECISION_KEY, "fp32") == "fp32"
            and len(proto.graph.output) == 1
            and opset in (None, version)
        ):
            log.info("int8: fp32 graph %s %s (same weights and T)", shipped, use)
            return proto
    with tempfile.TemporaryDirectory(prefix="capserve-int8-") as tmp:
        path = export_onnx(
            model, Path(tmp) / "fp32.onnx", iterations, opset=opset or DEFAULT_OPSET, weights_digest=digest
        )
        return onnx.load(str(path))


def export_int8(
    checkpoint: str | Path,
    output: str | Path,
    calibration: str | Path,
    *,
    iterations: int | None = None,
    images: int = DEFAULT_IMAGES,
    gate_images: int = GATE_IMAGES,
    min_agreement: float = MIN_AGREEMENT,
    force: bool = False,
    target: str = "onnxruntime",
    method: str = "minmax",
    opset: int | None = None,
    keep_float: Sequence[str] = (),
    max_float_nodes: int = MAX_FLOAT_NODES,
) -> tuple[Path, GateReport]:
    """Export a model directory to an INT8 QDQ ONNX file calibrated on ``calibration``, gated against FP32.

    Args:
        checkpoint: model directory (model.safetensors + config.json).
        output: the .onnx file to write.
        calibration: a folder or CSV (``capserve train --data`` layout) or a built-in dataset's folder.
        iterations: routing iterations T (default the config's).
        images: calibration images; gate_images: held-out images scored (at most).
        min_agreement: the gate's bound on top-1 (label-set) agreement; below it ``Int8GateError``, unless ``force``.
        target: ``onnxruntime`` (CPUs) or ``tensorrt`` (``capserve export tensorrt --int8``).
        keep_float: Conv/MatMul/Gemm node names to leave in float from the start.
        max_float_nodes: how many more nodes ``keep_sensitive_in_float`` may leave in float when the calibration
            images' agreement is below ``min_agreement`` (0: no search).
    Returns:
        The path written and the gate's report.
    """
    import onnx

    from capserve.export.onnx import load_checkpoint

    if not 0 <= min_agreement <= 1:
        raise ExportError(f"--min-agreement must be in [0, 1], got {min_agreement}")
    if max_float_nodes < 0:
        raise ExportError(f"--max-float-nodes must be >= 0, got {max_float_nodes}")
    model, digest = load_checkpoint(checkpoint)
    data = read_calibration(calibration, model.config, images, gate_images)
    fp32_proto = fp32_graph(checkpoint, model, digest, iterations, opset)
    fp32 = _session(fp32_proto)
    with Quantizer(fp32_proto, data.images, target, method) as quantizer:
        kept, calibration_agreement, steps = keep_sensitive_in_float(
            quantizer, fp32, min_agreement, max_float_nodes, keep_float
        )
        proto = quantizer.build(kept)
        float_nodes = quantizer.activation_products + kept
    int8 = _session(proto)
    report = score(fp32, int8, data.held_out, data.targets, data.split, min_agreement)
    log.debug("%s", report)
    searched = f"; left in float by the search: {', '.join(s.node for s in steps)}" if steps else ""
    if not report.passed and not force:
        why = diagnose(
            (_logits(fp32, data.held_out), _logits(int8, data.held_out)),
            (_logits(fp32, data.images), _logits(int8, data.images)),
            fp32.metadata,
            min_agreement,
            f"{len(data.images)} of --calibration {calibration}",
            max_float_nodes,
        )
        raise Int8GateError(f"not written: {report}{searched}.\n{why}\nOr pass --force to write it anyway")
    c = report.check
    summary = Int8Summary(
        target=target,
        method=method,
        calibration=str(calibration),
        calibration_images=len(data.images),
        stratified=data.stratified,
        quantized_ops=QUANTIZED_OPS,
        float_nodes=tuple(float_nodes),
        kept_float=tuple(kept),
        calibration_agreement=calibration_agreement,
        gate_split=data.split,
        gate_images=c.images,
        agreement=c.agreement,
        bound=c.bound,
        metric=report.metric,
        fp32_accuracy=report.fp32_accuracy,
        int8_accuracy=report.int8_accuracy,
        forced=not report.passed,
    )
    set_metadata(proto, {**read_metadata(proto), INT8_KEY: summary.to_json()})
    onnx.checker.check_model(proto)
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(proto, str(output))
    return output, report


def read_summary(path: str | Path) -> Int8Summary:
    """The ``capserve.int8`` summary of an INT8 file (``ExportError`` for any other file)."""
    import onnx

    props = read_metadata(onnx.load(str(path), load_external_data=False))
    if props.get(PRECISION_KEY) != "int8" or INT8_KEY not in props:
        raise ExportError(
            f"{path} is not an int8 export ({PRECISION_KEY} {props.get(PRECISION_KEY, 'fp32')!r}); "
            "make one with `capserve export onnx MODEL_DIR -o OUT.onnx --int8 --calibration DATA`"
        )
    return Int8Summary.from_json(props[INT8_KEY])


def verify_int8(
    artifact: str | Path,
    checkpoint: str | Path,
    data: str | Path | None = None,
    min_agreement: float | None = None,
    gate_images: int = GATE_IMAGES,
) -> int:
    """``capserve verify --int8``: the export's gate again, FP32 (from ``checkpoint``, at the file's T) against
    the INT8 file, on the held-out images of ``data`` (default: the calibration data the file records). Prints the
    report; returns 0 when it passes, 1 when not."""
    from capserve.export.onnx import load_checkpoint
    from capserve.runtime.onnx_backend import OnnxRuntime

    summary = read_summary(artifact)
    int8 = OnnxRuntime(artifact)
    model, digest = load_checkpoint(checkpoint)
    if int8.metadata.weights_sha256 != digest:
        log.warning("%s was exported from another weights file than %s", artifact, checkpoint)
    data = data or summary.calibration
    held = read_calibration(data, model.config, summary.calibration_images, gate_images)
    # the reference, named so in the log: verifying quantizes nothing
    fp32 = _session(fp32_graph(checkpoint, model, digest, int8.metadata.iterations, use="as the reference"))
    bound = summary.bound if min_agreement is None else min_agreement
    report = score(fp32, int8, held.held_out, held.targets, held.split, bound)
    print(
        f"{artifact}: {int8.metadata.name}, int8 ({summary.target}, {summary.method} on "
        f"{summary.calibration_images} images of {summary.calibration}); fp32 reference {checkpoint}; data {data}"
    )
    print(report)
    print("passed" if report.passed else "FAILED: agreement below the bound")
    return 0 if report.passed else 1


# ------------------------------------------------------------------------------------------------ command line


def add_int8_arguments(p: Any) -> None:
    """``capserve export onnx``'s INT8 options."""
    p.add_argument("--int8", action="store_true", help="INT8 QDQ graph calibrated on --calibration, gated against FP32")
    p.add_argument(
        "--calibration",
        help="calibration images: a folder or CSV in `capserve train --data` layout (or a built-in dataset's folder)",
    )
    p.add_argument(
        "--calibration-images",
        type=int,
        default=DEFAULT_IMAGES,
        help="images to calibrate on, stratified by label when it can (default %(default)s)",
    )
    p.add_argument("--calibration-method", choices=METHODS, default="minmax", help="(default %(default)s)")
    p.add_argument(
        "--int8-target",
        choices=list(TARGETS),
        default="onnxruntime",
        help="onnxruntime: uint8 activations for CPUs; tensorrt: symmetric int8 for `capserve export "
        "tensorrt --int8` (default %(default)s)",
    )
    p.add_argument(
        "--min-agreement",
        type=float,
        default=MIN_AGREEMENT,
        help="least top-1 (label-set) agreement with FP32 on held-out images (default %(default)s)",
    )
    p.add_argument(
        "--keep-float",
        nargs="+",
        default=[],
        metavar="NODE",
        help="Conv/MatMul/Gemm nodes to leave in float (names as in the graph; a wrong one lists them)",
    )
    p.add_argument(
        "--max-float-nodes",
        type=int,
        default=MAX_FLOAT_NODES,
        help="when INT8 agrees with FP32 below --min-agreement on the calibration images, leave up to N "
        "more of the most sensitive nodes in float (0: never; default %(default)s)",
    )
    p.add_argument("--gate-images", type=int, default=GATE_IMAGES, help="held-out images scored (default %(default)s)")
    p.add_argument("--force", action="store_true", help="write the INT8 file even when it fails the agreement gate")


def export_int8_from_args(args: Any) -> Path:
    """``capserve export onnx --int8``: export, print the gate's figures, refuse (``Int8GateError``) below the bound."""
    if not args.calibration:
        raise ExportError("--int8 needs --calibration DATA: a folder or CSV of images like the ones you will serve")
    if args.fp16 or args.explain:
        raise ExportError("--int8 writes a plain INT8 graph: drop --fp16 / --explain (export those separately)")
    if args.iterations and len(args.iterations) > 1:
        raise ExportError("--int8 exports one routing iteration count at a time: give one -T")
    path, report = export_int8(
        args.checkpoint,
        args.output,
        args.calibration,
        iterations=args.iterations[0] if args.iterations else None,
        images=args.calibration_images,
        gate_images=args.gate_images,
        min_agreement=args.min_agreement,
        force=args.force,
        target=args.int8_target,
        method=args.calibration_method,
        opset=args.opset,
        keep_float=args.keep_float,
        max_float_nodes=args.max_float_nodes,
    )
    print(report)
    if not report.passed:
        print(f"warning: written with --force below the bound {args.min_agreement:g}")
    return path
