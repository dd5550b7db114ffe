"""The shipped ONNX graphs as they are (fp32 ``model.onnx`` and INT8 ``model-int8.onnx``) on the full test sets:
top-1 (CIFAR-10) or exact match (DiverseMultiMNIST) of each, how often the INT8 graph decides as fp32, and the
export's gate record beside it. Nothing is exported or quantized here. Prints; asserts nothing.

    python benchmarks/score_graphs.py --cifar10 DATA/cifar10 --mnist DATA/mnist
"""

from __future__ import annotations

import argparse
from pathlib import Path

from capserve.data import load_test
from capserve.data.preprocess import normalize_images
from capserve.export.gate import accuracy
from capserve.export.int8 import read_summary
from capserve.hardware import cpu_info
from capserve.runtime import load_runtime
from capserve.runtime.precision import agreement

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    print(f"# CPU: {cpu_info().describe()}", flush=True)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cifar10", help="CIFAR-10 folder (python pickles)")
    p.add_argument("--mnist", help="MNIST folder (IDX files)")
    args = p.parse_args()
    for name, data in (("cifar10", args.cifar10), ("multimnist", args.mnist)):
        if not data:
            continue
        folder = ROOT / "models" / name
        if not (folder / "model-int8.onnx").is_file():
            print(f"{name}: ships no INT8 graph (its card says why)")
            continue
        fp32 = load_runtime(folder / "model.onnx")
        int8 = load_runtime(folder / "model-int8.onnx")  # re-checked on this CPU as a server opens it
        meta = fp32.metadata
        test = load_test(name, data)
        x = normalize_images(test.images.numpy(), meta)  # (N, C, H, W)
        targets = test.targets.numpy()
        logits = {"fp32": fp32.predict_in_batches(x, 250), "int8": int8.predict_in_batches(x, 250)}
        metric = "exact match" if meta.task == "multi_label" else "top-1"
        score = {k: accuracy(v, targets, meta) for k, v in logits.items()}
        agreed = agreement(logits["fp32"], logits["int8"], meta)
        s = read_summary(folder / "model-int8.onnx")
        print(
            f"{name}: {len(x)} test images, {metric} fp32 {score['fp32']:.2%}, int8 {score['int8']:.2%} "
            f"({100 * (score['fp32'] - score['int8']):+.2f} points lost), int8 decides as fp32 on {agreed:.4f}; "
            f"export gate: {s.variant}, agreement {s.agreement:.4f} on {s.gate_images} validation images (bound "
            f"{s.bound:g}), {s.speedup:.2f}x fp32 at batch {s.batch} on {s.cpu and s.cpu.get('model')}",
            flush=True,
        )


if __name__ == "__main__":
    main()
