"""The command lines of ``capserve.export``: ``capserve export onnx|tensorrt|bentoml`` (``add_arguments``,
``run``) and ``capserve verify`` (``add_verify_arguments``, ``run_verify``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from capserve.errors import ExportError, UsageError
from capserve.runtime import BACKENDS, infer_backend, load_runtime
from capserve.runtime.metadata import ModelMetadata
from capserve.runtime.precision import PRECISIONS, SAMPLE_SIZE, resolve_precision, sample_images

from .calibration import DEFAULT_IMAGES, GATE_IMAGES
from .gate import INT8_MAX_ACCURACY_LOSS, INT8_MIN_AGREEMENT
from .int8 import Int8Summary, export_int8, read_summary
from .onnx import DEFAULT_OPSET, MIN_OPSET
from .quantize import MAX_FLOAT_NODES, METHODS, TARGETS
from .speed import MIN_SPEEDUP, SPEED_BATCH
from .verify import DEFAULTS, compare, load_images, verify_int8


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="format", required=True, metavar="{onnx,tensorrt,bentoml}")
    p = sub.add_parser("onnx", help="a checkpoint to ONNX, one file per routing iteration count T")
    p.add_argument("checkpoint", help="model directory (model.safetensors + config.json)")
    p.add_argument("-o", "--output", required=True, help="output .onnx; with several T, one stem-T<t>.onnx per T")
    p.add_argument("-T", "--iterations", type=int, nargs="+", help="routing iterations to unroll (default: config's)")
    p.add_argument("--opset", type=int, default=DEFAULT_OPSET, help=f"ONNX opset, >= {MIN_OPSET} (default %(default)s)")
    p.add_argument("--fp16", action="store_true", help="FP16 graph, LayerNorm and Softmax in FP32, FP32 input/output")
    p.add_argument("--explain", action="store_true", help="add the part_whole output (routing parse per class)")
    add_int8_arguments(p)

    t = sub.add_parser("tensorrt", help="an exported ONNX file to a TensorRT engine (on the GPU that will run it)")
    t.add_argument("onnx", help=".onnx file from `capserve export onnx`")
    t.add_argument("-o", "--output", required=True, help="engine file (.plan); its sidecar is written to <output>.json")
    t.add_argument("--min-batch", type=int, default=1)
    t.add_argument("--opt-batch", type=int, default=16)
    t.add_argument("--max-batch", type=int, default=64)
    t.add_argument("--timing-cache", help="timing cache file, read if present and updated after the build")
    t.add_argument("--fp16", action="store_true", help="convert an FP32 graph to FP16 first (LayerNorm/Softmax FP32)")
    t.add_argument("--workspace-gib", type=float, default=4.0, help="builder workspace limit (default %(default)s)")
    t.add_argument("--tf32", action="store_true", help="allow TF32 matrix products (faster, ~1e-3 relative error)")
    t.add_argument(
        "--int8",
        action="store_true",
        help="an INT8 QDQ graph (`export onnx --int8 --int8-target tensorrt`): explicit quantization",
    )

    b = sub.add_parser("bentoml", help="a model directory as one model in BentoML's model store (versioned tags)")
    b.add_argument("model", help="model directory (config.json + model.safetensors; ONNX graphs made when missing)")
    b.add_argument("--name", required=True, help="model name in the store, e.g. capserve-cifar10; prints NAME:VERSION")


def run(args: argparse.Namespace) -> int:
    try:
        if args.format == "bentoml":
            from capserve.export.bentoml import save_to_store

            paths = [save_to_store(args.model, args.name)]
        elif args.format == "onnx":
            from capserve.export.onnx import export_checkpoint

            if not Path(args.checkpoint).is_dir():
                raise UsageError(f"{args.checkpoint} is not a model directory (model.safetensors + config.json)")
            if args.int8:
                paths = [export_int8_from_args(args)]
            else:
                paths = export_checkpoint(
                    args.checkpoint,
                    args.output,
                    args.iterations,
                    opset=args.opset,
                    fp16=args.fp16,
                    explain=args.explain,
                )
        else:
            from capserve.export.tensorrt import build_engine

            paths = [
                build_engine(
                    args.onnx,
                    args.output,
                    args.min_batch,
                    args.opt_batch,
                    args.max_batch,
                    timing_cache=args.timing_cache,
                    fp16=args.fp16,
                    workspace_gib=args.workspace_gib,
                    tf32=args.tf32,
                    int8=args.int8,
                )
            ]
    except ImportError as e:
        raise UsageError(f"{e}; export needs `pip install 'capserve[export,serve]'`") from e
    for path in paths:
        print(path)
    return 0


def add_int8_arguments(p: argparse.ArgumentParser) -> None:
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
    add_int8_gate_arguments(p)


def add_int8_gate_arguments(p: argparse.ArgumentParser) -> None:
    """``capserve export onnx --int8``'s bounds (agreement, accuracy, speed), the nodes it may leave in float to meet
    them, and the flags that write the file when it does not."""
    p.add_argument(
        "--min-agreement",
        type=float,
        default=INT8_MIN_AGREEMENT,
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
    p.add_argument(
        "--max-accuracy-loss",
        type=float,
        default=100 * INT8_MAX_ACCURACY_LOSS,
        metavar="POINTS",
        help="most top-1 (exact match) accuracy int8 may lose on labelled held-out images, in points, never below "
        "one image's share (default %(default)s)",
    )
    p.add_argument("--gate-images", type=int, default=GATE_IMAGES, help="held-out images scored (default %(default)s)")
    p.add_argument(
        "--force", action="store_true", help="write the INT8 file even when it fails the agreement or accuracy gate"
    )
    p.add_argument(
        "--min-speedup",
        type=float,
        default=MIN_SPEEDUP,
        help=f"least batch-{SPEED_BATCH} speed-up over fp32 on this machine (ONNX Runtime; default %(default)s)",
    )
    p.add_argument(
        "--keep-slow", action="store_true", help="write the INT8 file even when it is slower than --min-speedup"
    )


def export_int8_from_args(args: argparse.Namespace) -> Path:
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
        max_accuracy_loss=args.max_accuracy_loss / 100,
        force=args.force,
        min_speedup=args.min_speedup,
        keep_slow=args.keep_slow,
        target=args.int8_target,
        method=args.calibration_method,
        opset=args.opset,
        keep_float=args.keep_float,
        max_float_nodes=args.max_float_nodes,
    )
    print(report)
    summary = read_summary(path)
    print(speed_lines(summary))
    if not report.check.passed:
        print(f"warning: written with --force below the bound {args.min_agreement:g}")
    if not report.accuracy_passed:
        print(f"warning: written with --force, losing more than {100 * report.loss_bound:.2f} points")
    if summary.kept_slow:
        print(f"warning: written with --keep-slow below {summary.min_speedup:g}x fp32")
    return path


def speed_lines(summary: Int8Summary) -> str:
    """The variants an export tried on this machine and the one it kept, as printed after the gate's report."""
    cpu = (summary.cpu or {}).get("model", "this CPU")
    rows = [f"variants tried on {cpu} (batch {summary.batch or SPEED_BATCH}):"]
    for v in summary.variants:
        lost = "" if v["lost"] is None else f", {100 * v['lost']:.2f} points lost"
        speed = "not timed" if v["speedup"] is None else f"{v['speedup']:.2f}x fp32"
        kept = " (kept)" if v["variant"] == summary.variant else ""
        gate = "passed" if v["passed"] else "below the gate"
        rows.append(f"  {v['variant']:<10} agreement {v['agreement']:.4f}{lost}, {gate}, {speed}{kept}")
    return "\n".join(rows)


def add_verify_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("artifact", help=".onnx file, TensorRT engine (.plan) or model directory")
    parser.add_argument(
        "--against",
        help="the checkpoint (model directory) it was exported from (default: the "
        "artifact, when it is a model directory)",
    )
    parser.add_argument("--images", help="folder of images to use (default: seeded random images)")
    parser.add_argument(
        "--batch-sizes", help=f"comma-separated (default 1,7,64; {SAMPLE_SIZE} at bf16: the service's start-up check)"
    )
    parser.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="fp32",
        help="torch backend (a model directory): fp32, bf16 autocast, or auto (bf16 where the CPU "
        "has native bf16) (default %(default)s)",
    )
    parser.add_argument("--backend", choices=list(BACKENDS), help="default: from the artifact's file name")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default %(default)s)")
    parser.add_argument("--atol", type=float, help="logit tolerance (default 1e-4 FP32, 2e-2 FP16)")
    parser.add_argument("--rtol", type=float, help="logit tolerance per unit of max |logit| (1e-4 FP32, 0.1 FP16)")
    parser.add_argument("--min-agreement", type=float, help="least top-1 agreement (default 1.0 FP32, 0.95 FP16)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random images (default %(default)s)")
    parser.add_argument(
        "--int8",
        action="store_true",
        help="an INT8 export: repeat its gate (agreement and accuracy on held-out images of --data)",
    )
    parser.add_argument("--data", help="--int8: the images to hold out (default: the calibration data it records)")


def parse_batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError as e:
        raise UsageError(f"--batch-sizes must be comma-separated integers like 1,7,64, got {text!r}") from e
    if not sizes or min(sizes) < 1:
        raise UsageError(f"--batch-sizes needs positive integers, got {text!r}")
    return sizes


def run_verify(args: argparse.Namespace) -> int:
    """``capserve verify``: prints the comparison per batch size; 1 when a tolerance is exceeded."""
    from capserve.runtime.torch_backend import TorchRuntime

    against = args.against or (args.artifact if Path(args.artifact).is_dir() else None)
    if against is None:
        raise UsageError(f"give --against: the model directory {args.artifact} was exported from")
    if not Path(against).is_dir():
        raise UsageError(f"--against {against} is not a model directory (model.safetensors + config.json)")
    if args.int8:
        return verify_int8(args.artifact, against, args.data, args.min_agreement)
    options = {}
    if args.precision != "fp32":
        backend = args.backend or infer_backend(args.artifact)
        options["precision"], reason = resolve_precision(args.precision, backend, args.device)
        print(f"precision {options['precision']} ({reason})")
    sizes = parse_batch_sizes(
        args.batch_sizes or (str(SAMPLE_SIZE) if options.get("precision") == "bf16" else "1,7,64")
    )
    artifact = load_runtime(args.artifact, backend=args.backend, device=args.device, **options)
    meta = artifact.metadata
    reference = TorchRuntime(against, device="cpu", iterations=meta.iterations)
    weights_note = check_same_model(args.artifact, against, meta, reference.metadata)
    precision = artifact.precision
    atol, rtol, min_agreement = tolerances(args, precision)

    count = max(sizes)
    if args.images:
        images, source = load_images(args.images, meta, count), f"images from {args.images}"
    else:
        images, source = sample_images(meta, count, args.seed), f"random images (seed {args.seed})"
    routing = "no routing (CNN)" if meta.iterations is None else f"T={meta.iterations}"
    print(
        f"{args.artifact}: {meta.name}, {routing}, {precision}, {artifact.backend} on "
        f"{', '.join(artifact.providers)}; eager fp32 reference {against}; {source}{weights_note}"
    )
    agree = "labels agree" if meta.task == "multi_label" else "top-1 agree"  # per image, all decisions equal
    print(f"tolerance: max |Δlogit| <= {atol:g} + {rtol:g}·max|logit|, {agree} >= {min_agreement:g}")
    print(f"{'batch':>5}  {'max|Δlogit|':>11}  {'rel':>9}  {'max|Δprob|':>10}  {agree:>12}  result")
    failed = False
    for row in compare(reference, artifact, images, sizes):
        ok = row.within(atol, rtol, min_agreement)
        failed |= not ok
        print(
            f"{row.batch:>5}  {row.max_abs:>11.3e}  {row.max_rel:>9.2e}  {row.max_abs_prob:>10.3e}  "
            f"{row.agreement:>12.4f}  {'ok' if ok else 'FAIL'}"
        )
    print("FAILED: tolerances exceeded" if failed else "passed")
    return 1 if failed else 0


def check_same_model(artifact: str, against: str, meta: ModelMetadata, ref_meta: ModelMetadata) -> str:
    """``UsageError`` when ``artifact`` is another model than the checkpoint ``against``; a note for the report
    when it was exported from another weights file (maybe the same weights saved again)."""
    for field in ("name", "labels", "task", "in_channels", "image_size", "mean", "std"):
        if getattr(meta, field) != getattr(ref_meta, field):
            raise UsageError(
                f"{artifact} is a different model than {against}: {field} "
                f"{getattr(meta, field)!r} vs {getattr(ref_meta, field)!r}"
            )
    if meta.weights_sha256 == ref_meta.weights_sha256:
        return ""
    a, b = meta.weights_sha256[:12], ref_meta.weights_sha256[:12]
    return f"; note: weights_sha256 differs ({a}… vs {b}…): exported from another weights file"


def tolerances(args: argparse.Namespace, precision: str) -> tuple[float, float, float]:
    """``--atol``, ``--rtol`` and ``--min-agreement``, each defaulting to ``precision``'s (``DEFAULTS``)."""
    atol, rtol, min_agreement = DEFAULTS.get(precision, DEFAULTS["fp32"])
    return (
        atol if args.atol is None else args.atol,
        rtol if args.rtol is None else args.rtol,
        min_agreement if args.min_agreement is None else args.min_agreement,
    )
