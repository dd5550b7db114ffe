"""INT8 export: an FP32 graph quantized by ONNX Runtime (QDQ), calibrated on the user's images
(``capserve.export.calibration``) and refused below the gate (``capserve.export.gate``) unless forced.

Top to bottom: which nodes stay in float (``excluded_nodes``), the quantizer (``Quantizer``: pre-processing,
one calibration, ``quantize_static``), the sensitivity search (``keep_sensitive_in_float``), the TensorRT checks,
the summary the file records (``Int8Summary``, read back by ``capserve verify --int8``) and ``export_int8``.
docs/int8.md explains the choices and has the measurements behind the defaults.
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

from capserve.errors import ExportError, Int8GateError
from capserve.files import partial_file
from capserve.records import checked_fields
from capserve.runtime.metadata import METADATA_KEY, PRECISION_KEY, ModelMetadata
from capserve.runtime.precision import compare_precisions

from .calibration import DEFAULT_IMAGES, GATE_IMAGES, read_calibration
from .gate import INT8_MIN_AGREEMENT, GateReport, diagnose, score
from .onnx import DEFAULT_OPSET, export_onnx, load_checkpoint, read_metadata, set_metadata

log = logging.getLogger(__name__)

INT8_KEY = "capserve.int8"  # metadata_props key: the Int8Summary JSON
TARGETS = {"onnxruntime": "uint8 activations (x86 u8s8 kernels)", "tensorrt": "symmetric int8 activations"}
QUANTIZED_OPS = ("Conv", "MatMul", "Gemm")
METHODS = ("minmax", "percentile", "entropy")
# The most Conv/MatMul nodes the sensitivity search leaves in float (each costs speed; see keep_sensitive_in_float).
MAX_FLOAT_NODES = 3


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
        int8 = runtime_for(quantizer.build(nodes))
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


def runtime_for(proto: Any) -> Any:
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
        try:
            data = checked_fields(cls, json.loads(text), "int8 summary")
        except ValueError as e:  # json.JSONDecodeError included
            raise ExportError(
                f"{INT8_KEY!r} is not a capserve int8 summary ({e}); re-export with `capserve export onnx --int8`"
            ) from e
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
    min_agreement: float = INT8_MIN_AGREEMENT,
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

    if not 0 <= min_agreement <= 1:
        raise ExportError(f"--min-agreement must be in [0, 1], got {min_agreement}")
    if max_float_nodes < 0:
        raise ExportError(f"--max-float-nodes must be >= 0, got {max_float_nodes}")
    model, digest = load_checkpoint(checkpoint)
    data = read_calibration(calibration, model.config, images, gate_images)
    fp32_proto = fp32_graph(checkpoint, model, digest, iterations, opset)
    fp32 = runtime_for(fp32_proto)
    with Quantizer(fp32_proto, data.images, target, method) as quantizer:
        kept, calibration_agreement, steps = keep_sensitive_in_float(
            quantizer, fp32, min_agreement, max_float_nodes, keep_float
        )
        proto = quantizer.build(kept)
        float_nodes = quantizer.activation_products + kept
    int8 = runtime_for(proto)
    report = score(fp32, int8, data.held_out, data.targets, data.split, min_agreement)
    log.debug("%s", report)
    searched = f"; left in float by the search: {', '.join(s.node for s in steps)}" if steps else ""
    if not report.passed and not force:
        why = diagnose(
            (fp32.predict_in_batches(data.held_out, 100), int8.predict_in_batches(data.held_out, 100)),
            (fp32.predict_in_batches(data.images, 100), int8.predict_in_batches(data.images, 100)),
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
    with partial_file(output) as partial:  # a kill or a failure half-way leaves what was there whole
        onnx.save_model(proto, str(partial))
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
