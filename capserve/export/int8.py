"""INT8 export: an FP32 graph quantized by ONNX Runtime (QDQ), calibrated on the user's images
(``capserve.export.calibration``) and refused below the gate (``capserve.export.gate``) unless forced.

Top to bottom: which nodes stay in float (``excluded_nodes``), the ways to quantize (``VARIANTS``, the ones tried
on a CPU: ``variants_for``), the quantizer (``Quantizer``: pre-processing, one calibration, ``quantize_static``),
the sensitivity search (``keep_sensitive_in_float``), the speed measurement (``measure_speed``), the TensorRT
checks, the records the file keeps (``Int8Summary``, read back by ``capserve verify --int8``; the inputs it
re-checks where it is served, ``Int8Check``) and ``export_int8``. docs/int8.md explains the choices and has the
measurements behind the defaults.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from capserve.errors import ExportError, Int8GateError, Int8SpeedError
from capserve.files import partial_file
from capserve.hardware import CpuInfo, cpu_info
from capserve.records import checked_fields
from capserve.runtime.base import Runtime, in_worker_thread
from capserve.runtime.metadata import INT8_CHECK_KEY, METADATA_KEY, PRECISION_KEY, Int8Check, ModelMetadata
from capserve.runtime.precision import agreement, decisions

from .calibration import DEFAULT_IMAGES, GATE_IMAGES, read_calibration
from .gate import INT8_MAX_ACCURACY_LOSS, INT8_MIN_AGREEMENT, GateReport, diagnose, score_logits
from .onnx import DEFAULT_OPSET, export_onnx, load_checkpoint, read_metadata, set_metadata

log = logging.getLogger(__name__)

INT8_KEY = "capserve.int8"  # metadata_props key: the Int8Summary JSON
TARGETS = {"onnxruntime": "uint8 activations (x86 u8s8 kernels)", "tensorrt": "symmetric int8 activations"}
QUANTIZED_OPS = ("Conv", "MatMul", "Gemm")
METHODS = ("minmax", "percentile", "entropy")
# The most Conv/MatMul nodes the sensitivity search leaves in float (each costs speed; see keep_sensitive_in_float).
MAX_FLOAT_NODES = 3
# The least batch-32 speed-up over fp32 an int8 graph must show on the exporting machine to be written: below it
# int8's loss of accuracy buys too little (docs/int8.md, "Faster or refused"), and timings on a busy machine swing
# by a tenth between runs.
MIN_SPEEDUP = 1.2
SPEED_BATCH = 32  # the serving batch: the service's largest adaptive batch (CAPSERVE_MAX_BATCH_SIZE's default)
SPEED_ROUNDS = 7  # interleaved rounds of every graph; the medians are compared
# The calibration images an int8 graph records for the start-up check (``Int8Check``): at most this many, and at
# most this many bytes of pixels (a large input records fewer).
CHECK_IMAGES = 64
CHECK_BYTES = 256 * 1024


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


def measure_speed(
    runtimes: Mapping[str, Runtime],
    images: np.ndarray,
    batch: int = SPEED_BATCH,
    rounds: int = SPEED_ROUNDS,
    clock: Callable[[], float] | None = None,
) -> dict[str, float]:
    """Seconds per batch of each runtime on one batch of ``images`` (N, C, H, W; repeated up to ``batch``): after
    one warm-up run each, ``rounds`` rounds that run every runtime once, in turn (the order reversed every other
    round), so that a busy neighbour slows them alike; the median of each runtime's runs. Runs in a worker thread
    (inference in a process's main thread collapses on an oversubscribed CPU). ``clock``: ``time.perf_counter``."""
    if not len(images) or batch < 1 or rounds < 1:
        raise ExportError(f"speed needs images, batch >= 1 and rounds >= 1 (got {len(images)}, {batch}, {rounds})")
    clock = clock or time.perf_counter
    x = np.ascontiguousarray(np.resize(images, (batch, *images.shape[1:])))  # (batch, C, H, W)
    times: dict[str, list[float]] = {name: [] for name in runtimes}

    def work() -> None:
        for runtime in runtimes.values():
            runtime.predict(x)
        order = list(runtimes.items())
        for r in range(rounds):
            for name, runtime in order if r % 2 == 0 else order[::-1]:
                start = clock()
                runtime.predict(x)
                times[name].append(clock() - start)

    in_worker_thread(work, "capserve-int8-speed")
    return {name: statistics.median(t) for name, t in times.items()}


@dataclass(frozen=True)
class Candidate:
    """One variant's int8 graph, as the export measured it on this machine."""

    variant: str
    proto: Any
    kept: list[str]  # weighted nodes left in float
    calibration_agreement: float
    steps: list[SearchStep]
    report: GateReport
    runtime: Runtime
    seconds: float | None = None  # per batch of SPEED_BATCH; None when not timed (TensorRT target)

    @property
    def images_per_s(self) -> float | None:
        return None if self.seconds is None else SPEED_BATCH / max(self.seconds, 1e-12)

    def speedup(self, fp32_seconds: float | None) -> float | None:
        """fp32's time over int8's, on the same batch (None when either was not timed)."""
        return None if self.seconds is None or fp32_seconds is None else fp32_seconds / max(self.seconds, 1e-12)

    def row(self, fp32_seconds: float | None) -> dict[str, Any]:
        """What ``Int8Summary.variants`` records of it."""
        speedup = self.speedup(fp32_seconds)
        return {
            "variant": self.variant,
            "agreement": self.report.check.agreement,
            "lost": self.report.lost,
            "passed": self.report.passed,
            "kept_float": list(self.kept),
            "images_per_s": self.images_per_s,
            "speedup": speedup,
        }


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
    # Where it was measured and how fast; absent from files of older capserve versions (read back as None / empty)
    variant: str = "u8s8"  # VARIANTS: the quantization kept
    cpu: dict[str, Any] | None = None  # the exporting machine's processor (CpuInfo.to_dict())
    max_accuracy_loss: float | None = None  # the gate's bound on accuracy lost (a fraction), with labels
    batch: int | None = None  # the batch the speed was measured at
    fp32_images_per_s: float | None = None
    int8_images_per_s: float | None = None
    speedup: float | None = None  # int8 over fp32 images/s at ``batch`` on the exporting machine
    min_speedup: float | None = None  # the bound it was held to (None: not measured, e.g. for TensorRT)
    kept_slow: bool = False  # written with --keep-slow below min_speedup
    variants: tuple[dict[str, Any], ...] = ()  # every variant tried (Candidate.row)

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
                "variants": tuple(data.get("variants") or ()),
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
    max_accuracy_loss: float = INT8_MAX_ACCURACY_LOSS,
    force: bool = False,
    min_speedup: float = MIN_SPEEDUP,
    keep_slow: bool = False,
    target: str = "onnxruntime",
    method: str = "minmax",
    opset: int | None = None,
    keep_float: Sequence[str] = (),
    max_float_nodes: int = MAX_FLOAT_NODES,
    cpu: CpuInfo | None = None,
    variants: Sequence[str] | None = None,
    clock: Callable[[], float] | None = None,
) -> tuple[Path, GateReport]:
    """Export a model directory to an INT8 QDQ ONNX file calibrated on ``calibration``, gated against FP32 on its
    decisions, its accuracy and, for ONNX Runtime, its speed on this machine.

    Args:
        checkpoint: model directory (model.safetensors + config.json).
        output: the .onnx file to write.
        calibration: a folder or CSV (``capserve train --data`` layout) or a built-in dataset's folder.
        iterations: routing iterations T (default the config's).
        images: calibration images; gate_images: held-out images scored (at most).
        min_agreement: the gate's bound on top-1 (label-set) agreement; below it ``Int8GateError``, unless ``force``.
        max_accuracy_loss: the gate's bound on the accuracy int8 loses (a fraction) when the held-out images have
            labels (never below one image's share); above it ``Int8GateError``, unless ``force``.
        min_speedup: the least batch-32 speed-up over fp32 on this machine (``target`` onnxruntime); below it
            ``Int8SpeedError``, unless ``keep_slow``.
        target: ``onnxruntime`` (CPUs) or ``tensorrt`` (``capserve export tensorrt --int8``; not timed here).
        keep_float: Conv/MatMul/Gemm node names to leave in float from the start.
        max_float_nodes: how many more nodes ``keep_sensitive_in_float`` may leave in float when the calibration
            images' agreement is below ``min_agreement`` (0: no search).
        cpu: the processor the variants are chosen for (``variants_for``) and the record names (default this one).
        variants: the ``VARIANTS`` to try (default ``variants_for(cpu, target)``): of those that pass the gate, the
            fastest is kept.
        clock: the timer of ``measure_speed`` (default ``time.perf_counter``).
    Returns:
        The path written and the gate's report of the variant kept.
    """
    import onnx

    if not 0 <= min_agreement <= 1:
        raise ExportError(f"--min-agreement must be in [0, 1], got {min_agreement}")
    if not 0 <= max_accuracy_loss <= 1:
        raise ExportError(f"--max-accuracy-loss must be in [0, 100] points, got {100 * max_accuracy_loss:g}")
    if max_float_nodes < 0:
        raise ExportError(f"--max-float-nodes must be >= 0, got {max_float_nodes}")
    if min_speedup <= 0:
        raise ExportError(f"--min-speedup must be > 0, got {min_speedup}")
    cpu = cpu or cpu_info()
    names = tuple(variants or variants_for(cpu, target))
    if unknown := sorted(set(names) - VARIANTS.keys()):
        raise ExportError(f"int8 variants {unknown}; choose from: {', '.join(VARIANTS)}")
    model, digest = load_checkpoint(checkpoint)
    data = read_calibration(calibration, model.config, images, gate_images)
    fp32_proto = fp32_graph(checkpoint, model, digest, iterations, opset)
    if not len(data.held_out):
        raise ExportError(
            "no held-out images to check the int8 graph on: give --calibration data with a test or "
            "val split, or more images than --calibration-images"
        )
    fp32 = runtime_for(fp32_proto)
    meta = fp32.metadata
    reference = fp32.predict_in_batches(data.images, 100)  # (N, C): the search's and the record's fp32 answers
    held_fp32 = fp32.predict_in_batches(data.held_out, 100)  # (M, C)
    candidates = []
    with Quantizer(fp32_proto, data.images, target, method) as quantizer:
        for name in names:
            kept, calibration_agreement, steps = keep_sensitive_in_float(
                quantizer, reference, min_agreement, max_float_nodes, keep_float, name
            )
            proto = quantizer.build(kept, name)
            int8 = runtime_for(proto)
            report = score_logits(
                held_fp32,
                int8.predict_in_batches(data.held_out, 100),
                meta,
                data.targets,
                data.split,
                min_agreement,
                max_accuracy_loss,
            )
            log.info("int8 %s: %s", name, report)
            candidates.append(Candidate(name, proto, kept, calibration_agreement, steps, report, int8))
        float_nodes = quantizer.activation_products
    passing = [c for c in candidates if c.report.passed]
    best_quality = max(candidates, key=lambda c: (c.report.check.agreement, -(c.report.lost or 0)))
    if not passing and not force:
        c = best_quality
        searched = f"; left in float by the search: {', '.join(s.node for s in c.steps)}" if c.steps else ""
        tried = f" ({c.variant}, the best of {', '.join(names)})" if len(names) > 1 else ""
        why = diagnose(
            (held_fp32, c.runtime.predict_in_batches(data.held_out, 100)),
            (reference, c.runtime.predict_in_batches(data.images, 100)),
            meta,
            min_agreement,
            f"{len(data.images)} of --calibration {calibration}",
            max_float_nodes,
        )
        raise Int8GateError(f"not written: {c.report}{tried}{searched}.\n{why}\nOr pass --force to write it anyway")
    seconds: dict[str, float] = {}
    if target == "onnxruntime":
        timed = passing or [best_quality]
        seconds = measure_speed({"fp32": fp32, **{c.variant: c.runtime for c in timed}}, data.held_out, clock=clock)
        candidates = [dataclasses.replace(c, seconds=seconds.get(c.variant)) for c in candidates]
        timed = [c for c in candidates if c.seconds is not None]
        chosen = min(timed, key=lambda c: (not c.report.passed, c.seconds))  # passing first, then the fastest
    else:
        chosen = passing[0] if passing else best_quality
    fp32_seconds = seconds.get("fp32")
    speedup = chosen.speedup(fp32_seconds)
    slow = speedup is not None and speedup < min_speedup
    if slow and not keep_slow:
        tried = f" (the fastest of {', '.join(names)} that passed the gate: {chosen.variant})" if len(names) > 1 else ""
        raise Int8SpeedError(
            f"not written: int8 runs at {speedup:.2f}x fp32 at batch {SPEED_BATCH} on this CPU ({cpu.describe()})"
            f"{tried}, below the {min_speedup:g}x it must gain to be worth its rounding; serve the fp32 graph, or "
            "pass --keep-slow to write it anyway"
        )
    report, c = chosen.report, chosen.report.check
    summary = Int8Summary(
        target=target,
        method=method,
        calibration=str(calibration),
        calibration_images=len(data.images),
        stratified=data.stratified,
        quantized_ops=QUANTIZED_OPS,
        float_nodes=tuple(float_nodes + chosen.kept),
        kept_float=tuple(chosen.kept),
        calibration_agreement=chosen.calibration_agreement,
        gate_split=data.split,
        gate_images=c.images,
        agreement=c.agreement,
        bound=c.bound,
        metric=report.metric,
        fp32_accuracy=report.fp32_accuracy,
        int8_accuracy=report.int8_accuracy,
        forced=not report.passed,
        variant=chosen.variant,
        cpu=cpu.to_dict(),
        max_accuracy_loss=max_accuracy_loss if report.lost is not None else None,
        batch=SPEED_BATCH if speedup is not None else None,
        fp32_images_per_s=None if fp32_seconds is None else SPEED_BATCH / max(fp32_seconds, 1e-12),
        int8_images_per_s=chosen.images_per_s,
        speedup=speedup,
        min_speedup=min_speedup if speedup is not None else None,
        kept_slow=slow,
        variants=tuple(x.row(fp32_seconds) for x in candidates),
    )
    check = check_record(chosen.runtime, data.pixels, data.images, reference, min_agreement, cpu)
    proto = chosen.proto
    set_metadata(proto, {**read_metadata(proto), INT8_KEY: summary.to_json(), INT8_CHECK_KEY: check.to_json()})
    onnx.checker.check_model(proto)
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    with partial_file(output) as partial:  # a kill or a failure half-way leaves what was there whole
        onnx.save_model(proto, str(partial))
    return output, report


def check_record(
    int8: Runtime, pixels: np.ndarray, images: np.ndarray, fp32_logits: np.ndarray, bound: float, cpu: CpuInfo
) -> Int8Check:
    """The inputs the int8 graph re-checks where it is opened: the first calibration images (uint8 ``pixels``,
    normalised ``images``, (N, C, H, W)) on which int8 decides as fp32 (``fp32_logits`` (N, C)) here, at most
    ``CHECK_IMAGES`` and ``CHECK_BYTES``; their int8 logits computed as the check computes them (batches of 64)."""
    int8_logits = int8.predict_in_batches(images, 100)  # (N, C)
    meta = int8.metadata
    same = (decisions(int8_logits, meta) == decisions(fp32_logits, meta)).all(axis=1)  # (N,)
    limit = max(1, min(CHECK_IMAGES, CHECK_BYTES // max(1, int(np.prod(pixels.shape[1:])))))
    chosen = np.flatnonzero(same)[:limit]
    if not len(chosen):  # int8 decides otherwise everywhere (a forced export): the check will refuse it anywhere
        chosen = np.arange(min(limit, len(images)))
    recorded = int8.predict_in_batches(np.ascontiguousarray(images[chosen]), 64)  # (n, C)
    return Int8Check.build(pixels[chosen], fp32_logits[chosen], recorded, bound, cpu.describe())


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
