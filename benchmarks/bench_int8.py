"""INT8 (ONNX Runtime, QDQ) beside fp32 (ONNX Runtime) and bf16 (torch) on the shipped models: img/s at batch 1 and
32, top-1 / exact match on the test sets, size on disk. Prints; asserts nothing.

    python benchmarks/bench_int8.py --cifar10 DATA/cifar10 --mnist DATA/mnist [--images N] [--reps R]

The int8 graph is made here as ``capserve export onnx --int8`` makes it: 512 stratified training images (CIFAR-10;
DiverseMultiMNIST: 512 images drawn from the training digits), the gate on 1,000 validation images.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from capserve.data import load_test
from capserve.data.preprocess import normalize_images
from capserve.export.gate import accuracy
from capserve.export.int8 import export_int8
from capserve.hardware import cpu_info
from capserve.runtime import load_runtime

ROOT = Path(__file__).resolve().parents[1]


def throughput(runtime, x: np.ndarray, batch: int, reps: int) -> float:
    """Median img/s over ``reps`` runs of one batch (after one warm-up), in a worker thread (see PITFALLS)."""
    result = {}

    def work() -> None:
        runtime.predict(x[:batch])
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            runtime.predict(x[:batch])
            times.append(time.perf_counter() - t0)
        result["ips"] = batch / statistics.median(times)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    return result["ips"]


def scores(runtime, x: np.ndarray, targets: np.ndarray, batch: int = 250) -> float:
    logits = np.concatenate([runtime.predict(x[i : i + batch]) for i in range(0, len(x), batch)])
    return accuracy(logits, targets, runtime.metadata)


def main() -> None:
    print(f"CPU: {cpu_info().describe()}", flush=True)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cifar10", required=True, help="CIFAR-10 folder (python pickles)")
    p.add_argument("--mnist", required=True, help="MNIST folder (IDX files)")
    p.add_argument("--images", type=int, default=10_000, help="test images scored per model (default all 10,000)")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--models", default="cifar10,multimnist", help="comma-separated shipped models")
    args = p.parse_args()
    print(
        f"{'model':<12}{'precision':<10}{'backend':<13}{'b1 img/s':>9}{'b32 img/s':>10}{'x fp32':>7}"
        f"{'metric':>13}{'score':>8}{'size MB':>8}"
    )
    for name, dataset, data in (("cifar10", "cifar10", args.cifar10), ("multimnist", "multimnist", args.mnist)):
        if name not in args.models.split(","):
            continue
        model = ROOT / "models" / name
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            int8_path, report = export_int8(model, Path(tmp) / "model-int8.onnx", data)
            print(f"# {name}: int8 export {time.perf_counter() - t0:.0f} s; gate: {report}", flush=True)
            runs = {  # int8 right after fp32: the target's comparison prints first (bf16 on an emulating CPU is slow)
                "fp32": (load_runtime(model / "model.onnx"), model / "model.onnx"),
                "int8": (load_runtime(int8_path), int8_path),
                "bf16": (load_runtime(model, "torch", precision="bf16"), model / "model.safetensors"),
            }
            test = load_test(dataset, data)
            n = min(args.images, len(test))
            meta = runs["fp32"][0].metadata
            x = normalize_images(test.images[:n].numpy(), meta)
            targets = test.targets[:n].numpy()
            speed = {
                k: (throughput(r, x, 1, args.reps * 4), throughput(r, x, 32, args.reps)) for k, (r, _) in runs.items()
            }
            metric = "exact match" if meta.task == "multi_label" else "top-1"
            for k, (r, path) in runs.items():
                b1, b32 = speed[k]
                row = (
                    f"{name:<12}{k:<10}{r.backend:<13}{b1:>9.1f}{b32:>10.1f}{b32 / speed['fp32'][1]:>7.2f}"
                    f"{metric:>13}{scores(r, x, targets):>8.2%}{path.stat().st_size / 1e6:>8.1f}"
                )
                print(row, flush=True)
            print(f"# {name}: scored on the first {n} of {len(test)} test images")


if __name__ == "__main__":
    main()
