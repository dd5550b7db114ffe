"""Own-images data path: cache build speed, cache reuse, and training throughput from the cache vs built-in CIFAR.

    python benchmarks/bench_data.py --cifar data/ --images 10000 --steps 30

1. Writes ``--images`` CIFAR-10 training pictures (32×32) as PNG files into label folders (``DIR/<label>/*.png``).
2. Builds the uint8 cache from them (``capserve.data.cache.build_cache``: decode through ``capserve.data.images``, the
   service's preprocessing) and reports images/s; then reads the cache back (the path a second run takes).
3. Trains ``--model`` for ``--steps`` steps (batch ``--batch-size``) from the folder (the cache; the first run
   builds it, the later ones reuse it) and from the built-in CIFAR-10 tensors, interleaved ``--repeats`` times
   in this process, and reports the median images/s of each: both feed the same uint8 tensors to the same loop,
   so the ratio should be about 1.
Timings on a shared machine are noisy: quote medians and the ratio measured in one run.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from capserve.configs import CIFAR10_LABELS
from capserve.data.builtin import load_cifar10
from capserve.data.cache import CACHE_FILE, build_cache
from capserve.data.own import InputSize, scan
from capserve.data.splits import Split
from capserve.hardware import cpu_info
from capserve.train.config import TrainConfig
from capserve.train.loop import train

VAL_SIZE = 500  # validation images carved from the training images in both runs


def write_pngs(split: Split, root: Path, n: int) -> float:
    """The first ``n`` images as PNGs in label folders; returns seconds."""
    t0 = time.perf_counter()
    for label in CIFAR10_LABELS:
        (root / label).mkdir(parents=True, exist_ok=True)
    pixels = split.images[:n].permute(0, 2, 3, 1).numpy()  # (n, 32, 32, 3)
    for i, (image, target) in enumerate(zip(pixels, split.targets[:n].tolist(), strict=True)):
        Image.fromarray(np.ascontiguousarray(image)).save(root / CIFAR10_LABELS[target] / f"{i:05d}.png")
    return time.perf_counter() - t0


def images_per_s(out: Path) -> float:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return rows[-1]["images_per_s"]


def main() -> None:
    print(f"CPU: {cpu_info().describe()}", flush=True)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--cifar",
        default="data",
        help="folder with cifar-10-batches-py, any usual layout (default: %(default)s)",
    )
    p.add_argument("--images", type=int, default=10_000)
    p.add_argument("--model", default="cifar10-simple")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workdir", help="keep the PNGs and runs here (default: a temporary folder, removed)")
    args = p.parse_args()
    if args.images <= VAL_SIZE:
        p.error(f"--images must be more than {VAL_SIZE} (the training runs hold {VAL_SIZE} out for validation)")
    logging.basicConfig(level=logging.WARNING)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-data-"))
    try:
        cifar_train = load_cifar10(args.cifar, train=True)
        folder = work / "pngs"
        write_s = write_pngs(cifar_train, folder, args.images)
        manifest = scan(folder)
        spec = InputSize(3, 32)
        cache = work / "cache.safetensors"
        t0 = time.perf_counter()
        built = build_cache(manifest, manifest.labels, spec, cache)
        build_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        reused = build_cache(manifest, manifest.labels, spec, cache)
        reuse_s = time.perf_counter() - t0
        assert reused.from_cache and torch.equal(reused.splits["train"].images, built.splits["train"].images)
        n = len(built.splits["train"])
        print(f"PNG files written: {args.images} in {write_s:.1f} s; cache file {cache.stat().st_size / 2**20:.1f} MiB")
        print(
            f"cache build: {n} images in {build_s:.2f} s = {n / build_s:,.0f} images/s "
            f"({torch.get_num_threads()} torch threads, {os.cpu_count()} CPUs)"
        )
        print(f"cache reuse: {reuse_s:.3f} s ({n / reuse_s:,.0f} images/s, fingerprint of {n} files included)")

        common = dict(
            model=args.model,
            epochs=1,
            batch_size=args.batch_size,
            max_steps=args.steps,
            test=False,
            device="cpu",
            eval_batch_size=500,
        )
        own_runs, builtin_runs = [], []
        for r in range(args.repeats):  # interleaved, so drifting load on the machine hits both alike
            own_out, builtin_out = work / f"own-{r}", work / f"builtin-{r}"
            if r:  # the first run decodes (with its validation carve) into its cache; the others reuse it
                own_out.mkdir(parents=True)
                shutil.copy(work / "own-0" / CACHE_FILE, own_out / CACHE_FILE)
            train(TrainConfig(data=str(folder), out=str(own_out), val_size=VAL_SIZE, **common))
            own_runs.append(images_per_s(own_out))
            train(TrainConfig(data=str(args.cifar), out=str(builtin_out), val_size=VAL_SIZE, **common))
            builtin_runs.append(images_per_s(builtin_out))
        own, builtin = statistics.median(own_runs), statistics.median(builtin_runs)
        print(f"training {args.model}, batch {args.batch_size}, {args.steps} steps, median of {args.repeats}:")
        print(f"  from the own-images cache : {own:7.1f} images/s  (runs: {', '.join(f'{v:.1f}' for v in own_runs)})")
        print(
            f"  from built-in CIFAR-10    : {builtin:7.1f} images/s  "
            f"(runs: {', '.join(f'{v:.1f}' for v in builtin_runs)})"
        )
        print(f"  ratio cache / built-in    : {own / builtin:.2f}")
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
