"""INT8 export: an FP32 graph quantized by ONNX Runtime (QDQ, ``capserve.export.quantize``), calibrated on the
user's images (``capserve.export.calibration``), refused below the gate (``capserve.export.gate``) unless forced
and, for ONNX Runtime, when too little faster than fp32 on the exporting machine (``capserve.export.speed``).

Top to bottom: the records the file keeps (``Int8Summary``, read back by ``capserve verify --int8``), the FP32
graph to quantize (``fp32_graph``), ``export_int8`` and its steps, and the inputs the graph re-checks where it is
served (``check_record``, an ``Int8Check``). docs/int8.md explains the choices and has the measurements behind the
defaults.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from capserve.errors import ExportError, Int8GateError
from capserve.files import partial_file
from capserve.hardware import CpuInfo, cpu_info
from capserve.records import checked_fields
from capserve.runtime.base import Runtime
from capserve.runtime.metadata import (
    CLASS_POSES,
    INT8_CHECK_KEY,
    LOGITS,
    METADATA_KEY,
    PRECISION_KEY,
    Int8Check,
    ModelMetadata,
)
from capserve.runtime.precision import decisions

from .calibration import DEFAULT_IMAGES, GATE_IMAGES, CalibrationSet, read_calibration
from .gate import INT8_MAX_ACCURACY_LOSS, INT8_MIN_AGREEMENT, GateReport, diagnose, score_logits
from .onnx import DEFAULT_OPSET, export_onnx, load_checkpoint, read_metadata, set_metadata
from .quantize import (
    MAX_FLOAT_NODES,
    QUANTIZED_OPS,
    Quantizer,
    chosen_variants,
    class_capsule_nodes,
    keep_sensitive_in_float,
    runtime_for,
)
from .speed import MIN_SPEEDUP, SPEED_BATCH, Candidate, best_quality, check_speedup, choose_variant

__all__ = ["INT8_KEY", "Int8Summary", "check_record", "export_int8", "fp32_graph", "read_summary"]

log = logging.getLogger(__name__)

INT8_KEY = "capserve.int8"  # metadata_props key: the Int8Summary JSON
# The calibration images an int8 graph records for the start-up check (``Int8Check``): at most this many, and at
# most this many bytes of pixels (a large input records fewer).
CHECK_IMAGES = 64
CHECK_BYTES = 256 * 1024


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

    @classmethod
    def of(
        cls,
        chosen: Candidate,
        candidates: Sequence[Candidate],
        float_nodes: Sequence[str],
        data: CalibrationSet,
        calibration: str | Path,
        target: str,
        method: str,
        cpu: CpuInfo,
        fp32_seconds: float | None,
        min_speedup: float,
    ) -> Int8Summary:
        """The record of the variant ``export_int8`` writes (``chosen``), of every variant it tried and of the
        activation products (``float_nodes``), always in float."""
        report, c, speedup = chosen.report, chosen.report.check, chosen.speedup(fp32_seconds)
        return cls(
            target=target,
            method=method,
            calibration=str(calibration),
            calibration_images=len(data.images),
            stratified=data.stratified,
            quantized_ops=QUANTIZED_OPS,
            float_nodes=tuple([*float_nodes, *chosen.kept]),
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
            max_accuracy_loss=report.max_loss if report.lost is not None else None,
            batch=SPEED_BATCH if speedup is not None else None,
            fp32_images_per_s=None if fp32_seconds is None else SPEED_BATCH / max(fp32_seconds, 1e-12),
            int8_images_per_s=chosen.images_per_s,
            speedup=speedup,
            min_speedup=min_speedup if speedup is not None else None,
            kept_slow=chosen.too_slow(fp32_seconds, min_speedup),
            variants=tuple(x.row(fp32_seconds) for x in candidates),
        )

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
            and [o.name for o in proto.graph.output] in ([LOGITS], [LOGITS, CLASS_POSES])  # no explanation graph
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
        keep_float: Conv/MatMul/Gemm node names to leave in float from the start; a capsule network's class
            capsule layer always stays in float (``class_capsule_nodes``).
        max_float_nodes: how many more nodes ``keep_sensitive_in_float`` may leave in float when the calibration
            images' agreement is below ``min_agreement`` (0: no search).
        cpu: the processor the variants are chosen for (``variants_for``) and the record names (default this one).
        variants: the ``VARIANTS`` to try (default ``variants_for(cpu, target)``): of those that pass the gate, the
            fastest is kept.
        clock: the timer of ``measure_speed`` (default ``time.perf_counter``).
    Returns:
        The path written and the gate's report of the variant kept.
    """
    check_options(min_agreement, max_accuracy_loss, max_float_nodes, min_speedup)
    cpu = cpu or cpu_info()
    names = chosen_variants(cpu, target, variants)
    data, fp32_proto = read_inputs(checkpoint, calibration, images, gate_images, iterations, opset)
    keep_float = tuple(dict.fromkeys((*keep_float, *class_capsule_nodes(fp32_proto))))
    fp32 = Fp32Answers.of(fp32_proto, data)
    with Quantizer(fp32_proto, data.images, target, method) as quantizer:
        candidates = [
            quantize_variant(quantizer, name, data, fp32, min_agreement, max_accuracy_loss, max_float_nodes, keep_float)
            for name in names
        ]
        float_nodes = quantizer.activation_products
    if not force and not any(c.report.passed for c in candidates):
        raise gate_refusal(best_quality(candidates), names, data, calibration, fp32, min_agreement, max_float_nodes)
    chosen, candidates, fp32_seconds = choose_variant(candidates, fp32.runtime, data.held_out, target, clock)
    check_speedup(chosen, fp32_seconds, min_speedup, keep_slow, names, cpu)
    summary = Int8Summary.of(
        chosen, candidates, float_nodes, data, calibration, target, method, cpu, fp32_seconds, min_speedup
    )
    check = check_record(chosen.runtime, data.pixels, data.images, fp32.calibration, min_agreement, cpu)
    return write_int8(chosen.proto, summary, check, output), chosen.report


@dataclass(frozen=True)
class Fp32Answers:
    """The FP32 graph, opened, and its logits: on the calibration images (the search's and the record's reference)
    and on the held-out images (the gate's)."""

    runtime: Runtime
    calibration: np.ndarray  # (N, C)
    held_out: np.ndarray  # (M, C)

    @classmethod
    def of(cls, proto: Any, data: CalibrationSet) -> Fp32Answers:
        """``proto`` opened (``runtime_for``) and run on ``data``'s calibration and held-out images."""
        fp32 = runtime_for(proto)
        return cls(fp32, fp32.predict_in_batches(data.images, 100), fp32.predict_in_batches(data.held_out, 100))


def check_options(min_agreement: float, max_accuracy_loss: float, max_float_nodes: int, min_speedup: float) -> None:
    """``ExportError`` for an ``export_int8`` bound out of its range, named by its command-line flag."""
    if not 0 <= min_agreement <= 1:
        raise ExportError(f"--min-agreement must be in [0, 1], got {min_agreement}")
    if not 0 <= max_accuracy_loss <= 1:
        raise ExportError(f"--max-accuracy-loss must be in [0, 100] points, got {100 * max_accuracy_loss:g}")
    if max_float_nodes < 0:
        raise ExportError(f"--max-float-nodes must be >= 0, got {max_float_nodes}")
    if min_speedup <= 0:
        raise ExportError(f"--min-speedup must be > 0, got {min_speedup}")


def read_inputs(
    checkpoint: str | Path,
    calibration: str | Path,
    images: int,
    gate_images: int,
    iterations: int | None,
    opset: int | None,
) -> tuple[CalibrationSet, Any]:
    """The calibration and held-out images (``ExportError`` without held-out ones) and the FP32 graph to quantize."""
    model, digest = load_checkpoint(checkpoint)
    data = read_calibration(calibration, model.config, images, gate_images)
    fp32_proto = fp32_graph(checkpoint, model, digest, iterations, opset)
    if not len(data.held_out):
        raise ExportError(
            "no held-out images to check the int8 graph on: give --calibration data with a test or "
            "val split, or more images than --calibration-images"
        )
    return data, fp32_proto


def quantize_variant(
    quantizer: Quantizer,
    variant: str,
    data: CalibrationSet,
    fp32: Fp32Answers,
    min_agreement: float,
    max_accuracy_loss: float,
    max_float_nodes: int,
    keep_float: Sequence[str],
) -> Candidate:
    """One variant's int8 graph, with ``keep_float`` and the search's nodes in float, scored by the gate against
    ``fp32``."""
    kept, calibration_agreement, steps = keep_sensitive_in_float(
        quantizer, fp32.calibration, min_agreement, max_float_nodes, keep_float, variant
    )
    proto = quantizer.build(kept, variant)
    int8 = runtime_for(proto)
    report = score_logits(
        fp32.held_out,
        int8.predict_in_batches(data.held_out, 100),
        fp32.runtime.metadata,
        data.targets,
        data.split,
        min_agreement,
        max_accuracy_loss,
    )
    log.info("int8 %s: %s", variant, report)
    return Candidate(variant, proto, kept, calibration_agreement, steps, report, int8)


def gate_refusal(
    best: Candidate,
    names: Sequence[str],
    data: CalibrationSet,
    calibration: str | Path,
    fp32: Fp32Answers,
    min_agreement: float,
    max_float_nodes: int,
) -> Int8GateError:
    """The refusal when no variant passes the gate: what ``best`` (``best_quality``) measured, the variants tried,
    the search's float nodes and the likelier causes (``diagnose``)."""
    searched = f"; left in float by the search: {', '.join(s.node for s in best.steps)}" if best.steps else ""
    tried = f" ({best.variant}, the best of {', '.join(names)})" if len(names) > 1 else ""
    why = diagnose(
        (fp32.held_out, best.runtime.predict_in_batches(data.held_out, 100)),
        (fp32.calibration, best.runtime.predict_in_batches(data.images, 100)),
        fp32.runtime.metadata,
        min_agreement,
        f"{len(data.images)} of --calibration {calibration}",
        max_float_nodes,
    )
    return Int8GateError(f"not written: {best.report}{tried}{searched}.\n{why}\nOr pass --force to write it anyway")


def write_int8(proto: Any, summary: Int8Summary, check: Int8Check, output: str | Path) -> Path:
    """``proto`` with its records (``INT8_KEY``, ``INT8_CHECK_KEY``), checked and written whole to ``output``."""
    import onnx

    set_metadata(proto, {**read_metadata(proto), INT8_KEY: summary.to_json(), INT8_CHECK_KEY: check.to_json()})
    onnx.checker.check_model(proto)
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    with partial_file(output) as partial:  # a kill or a failure half-way leaves what was there whole
        onnx.save_model(proto, str(partial))
    return output


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
