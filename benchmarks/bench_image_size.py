"""What a larger input costs: seconds per training epoch and per evaluation of the own-data model (``cifar10-conv`` with
the backbone ``capserve train`` gives a user's images) beside capserve's CNN baseline (``cifar10-conv-cnn``), at 32, 64
and 128 px.

    python benchmarks/bench_image_size.py --sizes 32,64,128 --images 1000

Per size, three models: the capsules with the capsule grid growing with the image (``stem_pool=1``), the capsules as
``capserve train --image-size N`` builds them (``stem_pool=N // 32``: the grid stays where it is at 32 px), and the CNN
baseline with the same stem; at 32 px also the capsules on the config's three conv layers and on five (``--set
backbone_layers=5``). Each runs ``--steps`` SGD steps at batch ``--batch-size`` on random images (after one warm-up
step), and one inference pass of ``--eval-batch`` images at the model's own routing iterations; the variants are
interleaved ``--repeats`` times in one process and the medians are scaled to an epoch of ``--images`` training images
and an evaluation of as many test images. Timings on a shared machine are noisy: quote the medians and ratios of one
run, with the CPU line.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch
from bench_finetune_speed import step_rate

from capserve.configs import get_config
from capserve.hardware import cpu_info
from capserve.model.factory import build_model
from capserve.train.rules import OWN_BACKBONE


@torch.no_grad()
def eval_seconds_per_image(model: torch.nn.Module, size: int, batch: int) -> float:
    model.eval()
    x = torch.randn(batch, model.config.in_channels, size, size)
    model(x)
    t0 = time.perf_counter()
    model(x)
    return (time.perf_counter() - t0) / batch


def main() -> None:
    print(f"CPU: {cpu_info().describe()}", flush=True)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="32,64,128", help="comma-separated input sides")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--images", type=int, default=1000, help="training (and test) images the figures are scaled to")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--eval-batch", type=int, default=100)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    labels = tuple(str(i) for i in range(a.classes))
    variants = {}
    for size in (int(s) for s in a.sizes.split(",")):
        pool = max(size // 32, 1)
        for name, model, stem_pool, overrides in (
            ("capsules, grid grows" if size > 32 else "capsules", "cifar10-conv", 1, OWN_BACKBONE),
            (f"capsules, stem_pool={pool}", "cifar10-conv", pool, OWN_BACKBONE),
            ("capsules, 3 conv layers", "cifar10-conv", 1, {}),
            ("capsules, 5 conv layers", "cifar10-conv", 1, {"backbone_layers": 5}),
            (f"CNN baseline, stem_pool={pool}", "cifar10-conv-cnn", pool, {}),
        ):
            if size == 32 and stem_pool == 1 and name.startswith("capsules, stem"):
                continue  # the same model as the first at 32 px
            if size != 32 and "conv layers" in name:
                continue  # the other backbones' cost, at 32 px alone
            config = dataclasses.replace(
                get_config(model, **overrides), labels=labels, image_size=size, stem_pool=stem_pool
            )
            torch.manual_seed(0)
            variants[(size, name)] = build_model(config)
    train: dict[tuple[int, str], list[float]] = {v: [] for v in variants}
    evaluation: dict[tuple[int, str], list[float]] = {v: [] for v in variants}
    for _ in range(a.repeats):
        for (size, name), model in variants.items():
            train[(size, name)].append(1 / step_rate(model, size, a.batch_size, a.steps, freeze=False))
            evaluation[(size, name)].append(eval_seconds_per_image(model, size, a.eval_batch))
    print(
        f"{a.classes} classes, batch {a.batch_size}, {torch.get_num_threads()} threads, median of {a.repeats} "
        f"interleaved runs of {a.steps} steps; an epoch of {a.images} images and an evaluation of {a.images}"
    )
    print("| input | model | capsule grid | s per epoch | s per evaluation |")
    print("|---|---|---|---:|---:|")
    for (size, name), model in variants.items():
        grid = model.config.spatial_sizes[0] if model.config.head == "capsules" else model.config.feature_size
        epoch = a.images * statistics.median(train[(size, name)])
        ev = a.images * statistics.median(evaluation[(size, name)])
        print(f"| {size}×{size} | {name} | {grid}×{grid} | {epoch:.1f} | {ev:.1f} |")


if __name__ == "__main__":
    main()
