"""Eager PyTorch vs ONNX Runtime (CPU): latency at batch 1, throughput at batch 64, for several T in one run.

Variants: ONNX Runtime at each graph optimisation level, INT8 dynamic quantisation (``quantize_dynamic``:
MatMul and Conv weights in INT8), the FP16 graph (``capserve export onnx --fp16``), and eager under bf16
autocast. Each is reported as a speed ratio to eager FP32 measured in the same run, beside its accuracy cost:
max |Δlogit| and top-1 agreement against eager FP32 on the same inputs, and real test accuracy when given a
trained checkpoint and CIFAR-10 (``--checkpoint DIR --cifar DIR``).

    python benchmarks/bench_runtime.py                       # cifar10-resnet, random weights, T = 1 2 3
    python benchmarks/bench_runtime.py --checkpoint models/cifar10 --cifar data/
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

import capserve
from capserve.export.onnx import export_onnx
from capserve.hardware import cpu_info
from capserve.runtime.onnx_backend import OnnxRuntime


def interleaved_medians(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds per call, timing the variants round-robin so that load from other processes on a shared
    machine falls on all of them alike (one warm-up call each first)."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    print(f"CPU: {cpu_info().describe()}", flush=True)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="cifar10-resnet", help="named config (random weights)")
    parser.add_argument("--checkpoint", help="trained model directory instead of random weights")
    parser.add_argument("--cifar", help="CIFAR-10 folder: report test accuracy of every variant")
    parser.add_argument("--limit", type=int, default=2000, help="test images used with --cifar")
    parser.add_argument("-T", "--iterations", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--repeats", type=int, default=11, help="timed runs per variant at batch 1")
    parser.add_argument("--repeats-64", type=int, default=5, help="timed runs per variant at batch 64")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    model = capserve.load(args.checkpoint) if args.checkpoint else capserve.create_model(args.model).eval()
    c = model.config
    rng = np.random.default_rng(0)
    x64 = rng.standard_normal((64, c.in_channels, c.image_size, c.image_size)).astype(np.float32)
    x1 = x64[:1].copy()
    test = None
    if args.cifar:
        from capserve.data.builtin import load_cifar10
        from capserve.data.preprocess import normalize

        split = load_cifar10(args.cifar, train=False)
        n = min(args.limit, len(split))
        test = (normalize(split.images[:n], c.mean, c.std).numpy(), split.targets[:n].numpy())

    print(
        f"{c.name} ({'checkpoint ' + args.checkpoint if args.checkpoint else 'random weights'}), "
        f"{args.threads} threads, torch {torch.__version__}, median of {args.repeats} (batch 1) / "
        f"{args.repeats_64} (batch 64) interleaved runs; × = speed-up over eager fp32"
    )
    header = (
        f"{'T':>2} {'variant':<22} {'b1 ms':>8} {'b1 ×':>6} {'b64 img/s':>10} {'b64 ×':>6} {'max|Δ|':>9} {'top-1':>7}"
    )
    print(header + (f" {'test acc':>8}" if test else ""))
    ort = dict(threads=args.threads, memory_arena=False)  # six sessions with arenas at their peaks: OOM at T=3
    with tempfile.TemporaryDirectory() as tmp:
        for T in args.iterations:
            fp32 = export_onnx(model, Path(tmp) / f"T{T}.onnx", T)
            variants: dict[str, Callable[[np.ndarray], np.ndarray]] = {}

            @torch.inference_mode()
            def eager(x: np.ndarray, T: int = T) -> np.ndarray:
                return model(torch.from_numpy(x), iterations=T).numpy()

            @torch.inference_mode()
            def eager_bf16(x: np.ndarray, T: int = T) -> np.ndarray:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    return model(torch.from_numpy(x), iterations=T).float().numpy()

            variants["eager fp32"] = eager
            variants["eager bf16 autocast"] = eager_bf16
            for level in ("disable", "basic", "extended", "all"):
                variants[f"ort {level}"] = OnnxRuntime(fp32, graph_optimization=level, **ort).predict
            with contextlib.suppress(Exception):  # quantisation support varies with onnxruntime versions
                from onnxruntime.quantization import QuantType, quantize_dynamic

                logging.getLogger().setLevel(logging.ERROR)  # its "consider pre-processing" advice, per file

                int8 = Path(tmp) / f"T{T}-int8.onnx"
                quantize_dynamic(str(fp32), str(int8), weight_type=QuantType.QInt8)
                variants["ort int8 dynamic"] = OnnxRuntime(int8, **ort).predict
            fp16 = export_onnx(model, Path(tmp) / f"T{T}-fp16.onnx", T, fp16=True)
            variants["ort fp16 graph"] = OnnxRuntime(fp16, **ort).predict

            reference = eager(x64)
            t1 = interleaved_medians({k: (lambda fn=fn: fn(x1)) for k, fn in variants.items()}, args.repeats)
            t64 = interleaved_medians({k: (lambda fn=fn: fn(x64)) for k, fn in variants.items()}, args.repeats_64)
            for name, fn in variants.items():
                out = fn(x64)
                diff = float(np.abs(out - reference).max())
                agree = float((out.argmax(1) == reference.argmax(1)).mean())
                speedup1, speedup64 = t1["eager fp32"] / t1[name], t64["eager fp32"] / t64[name]
                line = (
                    f"{T:>2} {name:<20} {t1[name] * 1e3:>8.2f} {speedup1:>6.2f} {64 / t64[name]:>10.1f} "
                    f"{speedup64:>6.2f} {diff:>9.2e} {agree:>7.3f}"
                )
                if test:
                    images, labels = test
                    preds = np.concatenate([fn(images[i : i + 64]).argmax(1) for i in range(0, len(images), 64)])
                    line += f" {float((preds == labels).mean()):>8.4f}"
                print(line, flush=True)


if __name__ == "__main__":
    main()
