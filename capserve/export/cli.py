"""``capserve export onnx|tensorrt|bentoml``: the command-line face of ``capserve.export``."""

from __future__ import annotations

import argparse
from pathlib import Path

from capserve.errors import UsageError

from .int8 import add_int8_arguments, export_int8_from_args
from .onnx import DEFAULT_OPSET, MIN_OPSET


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
