"""The INT8 quantizer: an FP32 graph quantized by ONNX Runtime (QDQ) for one target, in one of the ways a CPU may
run fastest, with the nodes int8 hurts most left in float.

Top to bottom: the ways to quantize (``VARIANTS``, the ones tried on a CPU: ``variants_for``), which nodes stay in
float (``excluded_nodes``), the quantizer (``Quantizer``: pre-processing, one calibration, ``quantize_static``), the
sensitivity search (``keep_sensitive_in_float``), the TensorRT checks and ``runtime_for``, which opens a graph in
memory. ``capserve.export.int8`` drives them; docs/int8.md explains the choices.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from capserve.errors import ExportError
from capserve.hardware import CpuInfo
from capserve.runtime.base import Runtime
from capserve.runtime.metadata import METADATA_KEY, PRECISION_KEY, ModelMetadata
from capserve.runtime.precision import agreement

from .onnx import read_metadata, set_metadata

__all__ = [
    "MAX_FLOAT_NODES",
    "METHODS",
    "QUANTIZED_OPS",
    "TARGETS",
    "VARIANTS",
    "Quantizer",
    "SearchStep",
    "Variant",
    "check_tensorrt_int8",
    "chosen_variants",
    "class_capsule_nodes",
    "excluded_nodes",
    "keep_sensitive_in_float",
    "quantize",
    "runtime_for",
    "search_float_nodes",
    "tensorrt_problems",
    "variants_for",
]

log = logging.getLogger(__name__)

TARGETS = {"onnxruntime": "uint8 activations (x86 u8s8 kernels)", "tensorrt": "symmetric int8 activations"}
QUANTIZED_OPS = ("Conv", "MatMul", "Gemm")
METHODS = ("minmax", "percentile", "entropy")
# The most Conv/MatMul nodes the sensitivity search leaves in float (each costs speed; see keep_sensitive_in_float).
MAX_FLOAT_NODES = 3


@dataclass(frozen=True)
class Variant:
    """One way to quantize for ONNX Runtime: the activation and weight types and whether weights keep 7 bits."""

    name: str
    signed_activations: bool  # int8 activations, symmetric (zero point 0); else uint8, asymmetric
    reduce_range: bool  # 7-bit weights: x86's u8s8 kernels without VNNI add pairs of products in 16 bits
    about: str


# ONNX Runtime's quantize_static advises, for x86 CPUs without VNNI, uint8 activations with int8 weights and
# reduce_range (7-bit weights) against saturation; with VNNI the same types at full range; on Arm int8 activations
# and weights. Which is fastest, and what each loses, is measured where the export runs (``variants_for``).
VARIANTS = {
    "u8s8": Variant("u8s8", False, False, "uint8 activations, int8 weights"),
    "u8s8-7bit": Variant("u8s8-7bit", False, True, "uint8 activations, 7-bit int8 weights (reduce_range)"),
    "s8s8": Variant("s8s8", True, False, "symmetric int8 activations and weights"),
}
X86 = ("x86_64", "amd64", "i386", "i686", "x86")


def variants_for(cpu: CpuInfo, target: str = "onnxruntime") -> tuple[str, ...]:
    """The variants an export tries on ``cpu``: TensorRT's one (symmetric int8, as explicit quantization needs);
    u8s8 alone on an x86 CPU with int8 dot products (VNNI, AMX); on one without, also 7-bit weights and int8
    activations (ONNX Runtime's advice; each measured); elsewhere (Arm) u8s8 and s8s8."""
    if target == "tensorrt":
        return ("s8s8",)
    if cpu.architecture.lower() not in X86:
        return ("u8s8", "s8s8")
    return ("u8s8",) if cpu.int8_dot_products else ("u8s8", "u8s8-7bit", "s8s8")


def chosen_variants(cpu: CpuInfo, target: str, variants: Sequence[str] | None = None) -> tuple[str, ...]:
    """The variants an export tries: ``variants`` (names in ``VARIANTS``) when given, else ``variants_for``."""
    names = tuple(variants or variants_for(cpu, target))
    if unknown := sorted(set(names) - VARIANTS.keys()):
        raise ExportError(f"int8 variants {unknown}; choose from: {', '.join(VARIANTS)}")
    return names


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


# ops that only move values: a quantized node reading the class capsules through them still quantizes them
SHAPE_OPS = ("Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze", "Identity")


def class_capsule_nodes(proto: Any) -> list[str]:
    """The Conv/MatMul/Gemm nodes that read the graph's ``class_poses`` output (the read-out of the logits), left in
    float: quantizing them puts a quantize-dequantize pair on the class capsules themselves, and the int8 graph would
    return capsules rounded by as much as the unfamiliarity score's own spread (``capserve.runtime.familiarity``,
    whose calibration reads fp32 capsules). [] for a graph without that output (a CNN)."""
    from capserve.runtime.metadata import CLASS_POSES

    if CLASS_POSES not in {o.name for o in proto.graph.output}:
        return []
    readers: dict[str, list[Any]] = {}
    for node in proto.graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    found: list[str] = []
    pending, seen = [CLASS_POSES], set()
    while pending:
        for node in readers.get(pending.pop(), []):
            if node.name in seen:
                continue
            seen.add(node.name)
            if node.op_type in QUANTIZED_OPS:
                found.append(node.name)
            elif node.op_type in SHAPE_OPS:
                pending.extend(node.output)
    return sorted(found)


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

    def build(self, keep_float: Sequence[str] = (), variant: str | None = None) -> Any:
        """The QDQ graph with ``keep_float`` (node names, see ``weighted``) and the activation products in float;
        ``variant`` (``VARIANTS``): the types to quantize to (default: the target's, u8s8 or TensorRT's s8s8)."""
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
        tensorrt = self.target == "tensorrt"
        chosen = VARIANTS[variant or ("s8s8" if tensorrt else "u8s8")]
        symmetric = chosen.signed_activations
        out = Path(self._tmp.name) / "int8.onnx"
        with _quiet():
            quantize_static(
                str(self._pre),
                str(out),
                _Reader(self.fp32.graph.input[0].name, self.images),
                quant_format=QuantFormat.QDQ,
                per_channel=True,
                reduce_range=chosen.reduce_range,
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
                    "QuantizeBias": not tensorrt,
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
    quantizer: Quantizer,
    fp32: Runtime | np.ndarray,
    bound: float,
    max_nodes: int = MAX_FLOAT_NODES,
    keep_float: Sequence[str] = (),
    variant: str | None = None,
) -> tuple[list[str], float, list[SearchStep]]:
    """``search_float_nodes`` over the quantizer's weighted nodes, scored by INT8-vs-FP32 agreement on the
    *calibration* images, not the held-out ones, so that the gate that follows is an unbiased check of the choice.
    ``fp32``: the fp32 runtime, or its logits on the calibration images (N, C)."""
    if isinstance(fp32, Runtime):
        meta, reference = fp32.metadata, fp32.predict_in_batches(quantizer.images, 100)
    else:
        meta, reference = ModelMetadata.from_json(read_metadata(quantizer.fp32)[METADATA_KEY]), fp32

    def agreement_with(nodes: list[str]) -> float:
        int8 = runtime_for(quantizer.build(nodes, variant))
        return agreement(reference, int8.predict_in_batches(quantizer.images, 100), meta)

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


def runtime_for(proto: Any) -> Any:
    """An ``OnnxRuntime`` for an in-memory graph (written to a temporary file: the runtime opens paths), opened as
    ``load_runtime`` opens a file for serving (one intra-op thread per core, threads sleeping between runs), without
    the start-up check of an int8 graph (the export is what makes its record)."""
    import onnx

    from capserve.runtime.onnx_backend import OnnxRuntime

    with tempfile.TemporaryDirectory(prefix="capserve-int8-") as tmp:
        path = Path(tmp) / "model.onnx"
        onnx.save_model(proto, str(path))
        return OnnxRuntime(path, threads=0, int8_check=False)
