"""Latency and peak memory per routing algorithm and iteration count on one backbone and batch (the paper's Figure 4,
bottom right), eager PyTorch beside ONNX Runtime, with the baseline CNNs as rows without iterations.

Usage:
    python benchmarks/bench_routing.py                         # batch 64, T = 1..5, 2 threads
    python benchmarks/bench_routing.py --batch 8 -T 1 2 3 --repeats 3 --no-memory

Rows: for each routing algorithm (attention, dynamic, em) the CIFAR-10 config on the simple backbone (32×32 inputs)
found in ``capserve.list_models()`` (algorithms without one in this checkout are listed as skipped), at each T; then
the CNNs: ``cifar10-simple-cnn`` (the same backbone, conv layers with the capsule layers' neurons, average pooling)
and ``cifar10-resnet18``. Random weights (speed does not depend on them).

Latency: median milliseconds per batch over ``--repeats`` rounds under ``torch.inference_mode()``, eager and ONNX
Runtime (CPU, the export of ``capserve.export.onnx`` with T unrolled) timed round-robin within each model
(``bench_runtime.interleaved_medians``), so that load from other processes falls on all of them alike. Peak memory:
the RSS high-water mark of a fresh process that builds the model (or opens the ONNX file) and runs the batch twice
(``bench_model.peak_rss_mb`` / ``onnx_peak_rss_mb``, the latter through capserve's ONNX Runtime wrapper with its default
memory budget, as served), and its rise over the same process's mark before the first run
(Δ: activations and workspace, without the interpreter, the libraries and the weights).
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from bench_model import export_for_peak, onnx_peak_rss_mb, peak_rss_mb
from bench_runtime import interleaved_medians

import capserve
from capserve.cli import parameter_count
from capserve.configs import CIFAR10_LABELS, ROUTING_ALGORITHMS
from capserve.export.onnx import export_onnx
from capserve.hardware import cpu_info
from capserve.runtime.onnx_backend import OnnxRuntime

CNN_ROWS = ("cifar10-simple-cnn", "cifar10-resnet18")


def routing_models() -> tuple[dict[str, str], list[str]]:
    """Routing algorithm → the CIFAR-10 simple-backbone config using it (the shortest name: not a "-small" variant),
    and the algorithms this checkout has no such config for."""
    found: dict[str, str] = {}
    for name in sorted(capserve.list_models(), key=len):
        c = capserve.get_config(name)
        simple_cifar10 = c.backbone == "simple" and c.labels == CIFAR10_LABELS and c.image_size == 32
        if c.has_routing and simple_cifar10 and c.routing_algorithm not in found:
            found[c.routing_algorithm] = name
    return found, [alg for alg in ROUTING_ALGORITHMS if alg not in found]


def latencies(
    name: str, Ts: list[int | None], batch: int, repeats: int, threads: int, onnx: bool, folder: Path
) -> dict[tuple[int | None, str], float]:
    """Median seconds per batch: (T, "eager" | "ort") → seconds, all of one model timed round-robin."""
    torch.manual_seed(0)
    model = capserve.create_model(name).eval()
    c = model.config
    x = np.random.default_rng(0).standard_normal((batch, c.in_channels, c.image_size, c.image_size), np.float32)
    runs: dict[tuple[int | None, str], Callable[[], object]] = {}
    for T in Ts:

        @torch.inference_mode()
        def eager(T: int | None = T) -> object:
            return model(torch.from_numpy(x), iterations=T)

        runs[T, "eager"] = eager
        if onnx:
            path = export_onnx(model, folder / f"{name}-T{T}.onnx", T)
            session = OnnxRuntime(path, threads=threads, memory_arena=False)
            runs[T, "ort"] = lambda session=session: session.predict(x)
    return interleaved_medians(runs, repeats)  # type: ignore[arg-type]


def main() -> None:
    print(f"CPU: {cpu_info().describe()}", flush=True)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("-T", "--iterations", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per variant (default %(default)s)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-RSS subprocesses")
    parser.add_argument("--no-onnx", action="store_true", help="eager PyTorch only")
    args = parser.parse_args()
    if args.batch < 1 or min(args.iterations) < 1 or args.repeats < 1:
        parser.error("--batch, --iterations and --repeats must be positive")

    torch.set_num_threads(args.threads)
    found, missing = routing_models()
    rows = [(alg, name, list(args.iterations)) for alg, name in found.items()]
    rows += [("none (CNN)", name, [None]) for name in CNN_ROWS]
    print(
        f"torch {torch.__version__}, {args.threads} threads, batch {args.batch}, median of {args.repeats} "
        "interleaved rounds; random weights"
    )
    if missing:
        print(f"skipped (no CIFAR-10 simple-backbone config in this checkout): {', '.join(missing)} routing")
    print()
    columns = [
        "routing",
        "model",
        "parameters",
        "T",
        "eager ms",
        "ONNX Runtime ms",
        "eager peak MB (Δ)",
        "ONNX Runtime peak MB (Δ)",
    ]
    print("| " + " | ".join(columns) + " |")
    print("|---|---|" + "---:|" * (len(columns) - 2))
    with tempfile.TemporaryDirectory() as tmp:
        for routing, name, Ts in rows:
            seconds = latencies(name, Ts, args.batch, args.repeats, args.threads, not args.no_onnx, Path(tmp))
            parameters = parameter_count(capserve.get_config(name))
            for T in Ts:
                eager_ms = f"{seconds[T, 'eager'] * 1e3:.1f}"
                ort_ms = "—" if args.no_onnx else f"{seconds[T, 'ort'] * 1e3:.1f}"
                eager_mb = ort_mb = "—"
                if not args.no_memory:
                    base, peak = peak_rss_mb(name, args.batch, T, args.threads)
                    eager_mb = f"{peak:.0f} ({peak - base:+.0f})"
                    if not args.no_onnx:
                        path = export_for_peak(name, T, str(Path(tmp) / f"{name}-{T}-peak"))
                        # capserve's ONNX Runtime wrapper as served: its default memory budget ("default")
                        peak_data = onnx_peak_rss_mb(path, args.batch, args.threads, "default", True)
                        base, peak = peak_data["base"], peak_data["peak"]
                        ort_mb = f"{peak:.0f} ({peak - base:+.0f})"
                print(
                    f"| {routing} | {name} | {parameters:,} | {'—' if T is None else T} | {eager_ms} | {ort_ms} | "
                    f"{eager_mb} | {ort_mb} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
