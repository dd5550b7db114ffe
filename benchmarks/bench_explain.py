"""Does an explanation land on the object? Occlusion sensitivity and the routing parse of ``/explain``, on real
CIFAR-10 test images with a box drawn by eye around the object (``benchmarks/explain_boxes.json``).

For each image: the share of the map's mass inside the box, against the box's share of the image (what a uniform
map puts inside). The occlusion map's mass is its positive part (where greying lowered the predicted class's
log-odds); the routing parse's is the grid of mean routing probabilities to the predicted class. Also the time
of one occlusion map (all copies in one call) on the runtime given.

    python benchmarks/bench_explain.py --data data/                       # models/cifar10, ONNX Runtime
    python benchmarks/bench_explain.py --data data/ --backend torch
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from capserve.data.builtin import load_cifar10
from capserve.data.preprocess import normalize_images
from capserve.hardware import cpu_info
from capserve.pipeline.explain import occlusion
from capserve.runtime import load_runtime

ROOT = Path(__file__).resolve().parent.parent


def inside(mass: np.ndarray, box: list[int]) -> float:
    """Share of ``mass`` (H, W), non-negative, inside ``box`` [x0, y0, x1, y1]; NaN when it holds none."""
    x0, y0, x1, y1 = box
    total = mass.sum()
    return float(mass[y0:y1, x0:x1].sum() / total) if total > 0 else float("nan")


def main() -> None:
    print(f"CPU: {cpu_info().describe()}", flush=True)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="folder with cifar-10-batches-py/")
    parser.add_argument("--model", default=str(ROOT / "models" / "cifar10"))
    parser.add_argument("--backend", default="onnxruntime", choices=("onnxruntime", "torch"))
    parser.add_argument("--boxes", default=str(ROOT / "benchmarks" / "explain_boxes.json"))
    parser.add_argument(
        "--windows", default="4,7", help="occlusion windows per side to compare (4: what /explain serves)"
    )
    parser.add_argument("--batch-size", type=int, default=32, help="images per runtime call (the server's batch)")
    args = parser.parse_args()

    model = Path(args.model)
    runtime = load_runtime(model if args.backend == "torch" else model / "model.onnx", args.backend)
    explainer = load_runtime(model / "model-explain.onnx", "onnxruntime")
    meta = runtime.metadata
    test = load_cifar10(args.data, train=False)
    images, labels = test.images.numpy(), test.targets.numpy()
    boxes = json.loads(Path(args.boxes).read_text())["boxes"]
    for row in boxes:
        assert meta.labels[labels[row["index"]]] == row["label"], f"image {row['index']} is not a {row['label']}"

    def logits_of(copies: np.ndarray) -> np.ndarray:
        return runtime.predict_in_batches(normalize_images(copies, meta), args.batch_size)

    area = [(b[2] - b[0]) * (b[3] - b[1]) / (meta.image_size**2) for b in (row["box"] for row in boxes)]
    print(
        f"{len(boxes)} images, {meta.name} ({args.backend}); box share of the image (a uniform map): "
        f"mean {np.mean(area):.3f}"
    )
    print("| map | mass inside the box | ÷ box area | images above uniform | forward passes | ms per map (median) |")
    print("|---|---|---|---|---|---|")
    for windows in (int(w) for w in args.windows.split(",")):
        shares, times, passes = [], [], 0
        for row in boxes:
            pixels = images[row["index"]]  # (C, H, W)
            start = time.perf_counter()
            result = occlusion(pixels, np.asarray(meta.mean), logits_of, windows)
            times.append(time.perf_counter() - start)
            shares.append(inside(np.clip(result.pixels, 0, None), row["box"]))
            passes = result.forward_passes
        shares_a, area_a = np.array(shares), np.array(area)
        kept = ~np.isnan(shares_a)
        print(
            f"| occlusion {windows}×{windows} | {np.nanmean(shares_a):.3f} | "
            f"{np.nanmean(shares_a / area_a):.2f} | {int((shares_a[kept] > area_a[kept]).sum())}/{int(kept.sum())} | "
            f"{passes} | {1000 * statistics.median(times):.0f} |"
        )
    routing = []
    for row in boxes:
        x = normalize_images(images[row["index"]][None], explainer.metadata)
        explanation = explainer.explain(x)
        c = int(explanation.logits[0].argmax())
        grid = explanation.part_whole[0, c].mean(axis=-1)  # (h, w)
        cell = meta.image_size // grid.shape[0]
        routing.append(inside(np.kron(grid, np.ones((cell, cell))), row["box"]))
    routing_a = np.array(routing)
    print(
        f"| routing parse | {routing_a.mean():.3f} | {np.mean(routing_a / np.array(area)):.2f} | "
        f"{int((routing_a > np.array(area)).sum())}/{len(boxes)} | 1 | |"
    )


if __name__ == "__main__":
    main()
