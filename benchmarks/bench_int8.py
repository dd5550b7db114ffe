"""INT8 (ONNX Runtime, QDQ) beside fp32 (ONNX Runtime) and bf16 (torch) on the shipped models, on this machine:
img/s at batch 1 and 32 (interleaved rounds, medians), top-1 / exact match on the test sets, size on disk, and what
``capserve export onnx --int8`` decides here. Prints; asserts nothing.

    python benchmarks/bench_int8.py --cifar10 DATA/cifar10 [--mnist DATA/mnist] [--models cifar10,multimnist]
        [--variants u8s8,u8s8-7bit,s8s8] [--images N] [--rounds R]

The int8 graph is made as ``capserve export onnx --int8`` makes it (512 stratified training images for CIFAR-10;
for DiverseMultiMNIST 512 images drawn from the training digits; the gate on 1,000 validation images; on a CPU
without int8 dot products every variant ONNX Runtime advises, the fastest that passes kept), written even where the
export would refuse it, so that its figures can be seen. ``--variants`` adds one graph per named variant.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from capserve.data import load_test
from capserve.data.preprocess import normalize_images
from capserve.export.gate import accuracy
from capserve.export.int8 import export_int8, read_summary
from capserve.export.quantize import VARIANTS
from capserve.export.speed import measure_speed
from capserve.hardware import cpu_info
from capserve.runtime import load_runtime

ROOT = Path(__file__).resolve().parents[1]
DATASETS = {"cifar10": "cifar10", "multimnist": "multimnist"}


def scores(runtime, x: np.ndarray, targets: np.ndarray, batch: int = 250) -> float:
    return accuracy(runtime.predict_in_batches(x, batch), targets, runtime.metadata)


def decision(path: Path) -> str:
    """What ``capserve export onnx --int8`` (no --force, no --keep-slow) would have done with this graph."""
    s = read_summary(path)
    lost = "" if s.int8_accuracy is None else f", {100 * (s.fp32_accuracy - s.int8_accuracy):.2f} points lost"
    speed = "" if s.speedup is None else f", {s.speedup:.2f}x fp32 at batch {s.batch}"
    verdict = "refused (gate)" if s.forced else "refused (speed)" if s.kept_slow else "written"
    return f"{s.variant}: agreement {s.agreement:.4f}{lost}{speed} -> {verdict}"


def main() -> None:
    print(f"# CPU: {cpu_info().describe()}", flush=True)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cifar10", help="CIFAR-10 folder (python pickles)")
    p.add_argument("--mnist", help="MNIST folder (IDX files)")
    p.add_argument("--models", default="cifar10,multimnist", help="comma-separated shipped models")
    p.add_argument("--variants", default="", help=f"extra int8 graphs, comma-separated of: {', '.join(VARIANTS)}")
    p.add_argument("--images", type=int, default=10_000, help="test images scored per model (default all 10,000)")
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds at batch 32 (4x that at batch 1)")
    args = p.parse_args()
    folders = {"cifar10": args.cifar10, "multimnist": args.mnist}
    extra = [v for v in args.variants.split(",") if v]
    print(
        f"{'model':<12}{'precision':<16}{'backend':<13}{'b1 img/s':>9}{'b32 img/s':>10}{'x fp32':>7}"
        f"{'metric':>13}{'score':>8}{'lost':>7}{'size MB':>8}",
        flush=True,
    )
    for name in args.models.split(","):
        data = folders[name]
        if data is None:
            p.error(f"--models {name} needs --{'cifar10' if name == 'cifar10' else 'mnist'}")
        model = ROOT / "models" / name
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            path = Path(tmp) / "model-int8.onnx"
            _, report = export_int8(model, path, data, force=True, keep_slow=True)
            print(f"# {name}: int8 export {time.perf_counter() - t0:.0f} s; gate: {report}", flush=True)
            print(f"# {name}: the export here: {decision(path)}", flush=True)
            runs = {"fp32": (load_runtime(model / "model.onnx"), model / "model.onnx")}
            runs[f"int8 {read_summary(path).variant}"] = (load_runtime(path), path)
            for variant in extra:
                other = Path(tmp) / f"model-int8-{variant}.onnx"
                export_int8(model, other, data, force=True, keep_slow=True, variants=[variant])
                print(f"# {name}: --variants {variant}: {decision(other)}", flush=True)
                runs.setdefault(f"int8 {variant}", (load_runtime(other), other))
            runs["bf16"] = (load_runtime(model, "torch", precision="bf16"), model / "model.safetensors")
            test = load_test(DATASETS[name], data)
            n = min(args.images, len(test))
            meta = runs["fp32"][0].metadata
            x = normalize_images(test.images[:n].numpy(), meta)
            targets = test.targets[:n].numpy()
            runtimes = {k: r for k, (r, _) in runs.items()}
            b1 = measure_speed(runtimes, x, batch=1, rounds=4 * args.rounds)  # seconds per image
            b32 = measure_speed(runtimes, x, batch=32, rounds=args.rounds)  # seconds per batch of 32
            metric = "exact match" if meta.task == "multi_label" else "top-1"
            base = None
            for k, (r, file) in runs.items():
                score = scores(r, x, targets)
                base = score if base is None else base
                print(
                    f"{name:<12}{k:<16}{r.backend:<13}{1 / b1[k]:>9.1f}{32 / b32[k]:>10.1f}"
                    f"{b32['fp32'] / b32[k]:>7.2f}{metric:>13}{score:>8.2%}{100 * (base - score):>7.2f}"
                    f"{file.stat().st_size / 1e6:>8.1f}",
                    flush=True,
                )
            print(f"# {name}: scored on the first {n} of {len(test)} test images", flush=True)


if __name__ == "__main__":
    main()
