"""The own-images path on kinds of data it has not seen: build three data sets from the CIFAR-10/MNIST files, train
each with the documented command (``capserve train`` in a subprocess) and print the scores.

    python benchmarks/bench_own_data.py --data data/   # all three, the documented sizes
    python benchmarks/bench_own_data.py --data data/ --only pairs --augment none,crop-flip

1. ``pairs``: a multi-label CSV of 32×32 RGB images, each with two different MNIST digits (16×16) in two random
   quadrants, labels as words ("three seven"); ``--pairs-train`` train rows + ``--pairs-test`` test rows (split
   column). Trained with ``multimnist-matrix-small --set image_size=32 --lr 0.05 --schedule onecycle``.
   Target: >= 80 % exact match on the test rows after 30 epochs.
2. ``cifar``: a single-label folder (train/<label>/, test/<label>/) of CIFAR-10 *test* pictures upscaled to 64×64
   JPEG. Fine-tuned from ``--init`` (the shipped ``models/cifar10``, with and without ``--freeze backbone``) and
   trained from scratch (``cifar10-simple``). Target: fine-tuning clearly above scratch.
3. ``mnist``: a single-label folder of MNIST digits (28×28 PNG). Target: >= 97 % top-1 on its test/ folder.

Each run prints its command, its test score (``summary.json``'s ``test_acc``: top-1, or exact match with logits > 0),
the augmentation and weight decay it used, its training images/s and wall seconds. ``--augment a,b`` repeats each
run per policy and ``--weight-decay x,y`` per value (``default`` = no flag). Everything is written under ``--work``
(a temporary folder by default, removed at the end). Timings on a shared machine are noisy; scores are of one seed.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

from capserve.configs import CIFAR10_LABELS
from capserve.data.builtin import load_cifar10, load_mnist
from capserve.hardware import cpu_info

WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------ data sets


def make_pairs(
    digits: np.ndarray, labels: np.ndarray, n: int, split: str, root: Path, rng: np.random.Generator
) -> list[tuple[str, str, str]]:
    """``n`` 32×32 RGB PNGs holding two different digits (16×16) in two different quadrants; CSV rows."""
    (root / split).mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        a = int(rng.integers(len(digits)))
        b = int(rng.integers(len(digits)))
        while labels[b] == labels[a]:
            b = int(rng.integers(len(digits)))
        canvas = np.zeros((32, 32), np.uint8)
        for d, q in zip((a, b), rng.choice(4, size=2, replace=False), strict=True):
            small = np.asarray(Image.fromarray(digits[d]).resize((16, 16), Image.BILINEAR))
            y, x = 16 * (q // 2), 16 * (q % 2)
            canvas[y : y + 16, x : x + 16] = np.maximum(canvas[y : y + 16, x : x + 16], small)
        name = f"{split}/{i:05d}.png"
        Image.fromarray(np.stack([canvas] * 3, -1)).save(root / name)
        rows.append((name, f"{WORDS[labels[a]]} {WORDS[labels[b]]}", split))
    return rows


def build_pairs(data: Path, root: Path, n_train: int, n_test: int) -> Path:
    rng = np.random.default_rng(0)
    train_d, train_l = (t.numpy() for t in load_mnist(data, train=True))
    test_d, test_l = (t.numpy() for t in load_mnist(data, train=False))
    rows = make_pairs(train_d, train_l, n_train, "train", root, rng) + make_pairs(
        test_d, test_l, n_test, "test", root, rng
    )
    path = root / "pairs.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["image", "labels", "split"])
        w.writerows(rows)
    return path


def build_cifar_folder(data: Path, root: Path, n_train: int, n_test: int) -> Path:
    """CIFAR-10 test pictures (never seen by models/cifar10's training) upscaled to 64×64 JPEG, train/ and test/."""
    split = load_cifar10(data, train=False)
    pixels = split.images.permute(0, 2, 3, 1).numpy()  # (N, 32, 32, 3)
    for i in range(n_train + n_test):
        folder = root / ("train" if i < n_train else "test") / CIFAR10_LABELS[int(split.targets[i])]
        folder.mkdir(parents=True, exist_ok=True)
        image = Image.fromarray(np.ascontiguousarray(pixels[i])).resize((64, 64), Image.BICUBIC)
        image.save(folder / f"{i:05d}.jpg", quality=90)
    return root


def build_mnist_folder(data: Path, root: Path, n_train: int, n_test: int) -> Path:
    for split, train, n in (("train", True, n_train), ("test", False, n_test)):
        digits, labels = (t.numpy() for t in load_mnist(data, train=train))
        for i in range(n):
            folder = root / split / WORDS[int(labels[i])]
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(digits[i]).save(folder / f"{i:05d}.png")
    return root


# ------------------------------------------------------------------------------------------------ runs


def train(name: str, args: list[str], out: Path, augment: str, weight_decay: str = "default") -> dict:
    """``capserve train ARGS --out OUT`` in a subprocess; the figures of its summary and metrics."""
    cmd = [sys.executable, "-m", "capserve.cli", "train", *args, "--out", str(out)]
    if augment != "default":
        cmd += ["--augment", augment]
    if weight_decay != "default":
        cmd += ["--weight-decay", weight_decay]
    shown = " ".join(["capserve", *cmd[3:]])
    print(f"\n[{name}] {shown}", flush=True)
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode:
        print(done.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"[{name}] capserve train failed (exit {done.returncode})")
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rates = sorted(r["images_per_s"] for r in rows)
    decay = json.loads((out / "train_config.json").read_text())["weight_decay"]
    result = {
        "run": name,
        "augment": summary.get("augment"),
        "weight_decay": decay,
        "test_acc": summary.get("test_acc"),
        "best_val_acc": summary.get("best_val_acc"),
        "epochs": len(rows),
        "median_images_per_s": rates[len(rates) // 2],
        "wall_s": round(wall, 1),
        "command": shown,
    }
    print(
        f"[{name}] augment {result['augment']}, weight decay {decay:g}: test {100 * (result['test_acc'] or 0):.1f} "
        f"%, best val {100 * (result['best_val_acc'] or 0):.1f} %, {result['median_images_per_s']:.1f} images/s "
        f"(median epoch), {wall:.0f} s wall",
        flush=True,
    )
    return result


def main() -> None:
    print(f"CPU: {cpu_info().describe()}", flush=True)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--data",
        default="data",
        help="the folder with the CIFAR-10 and MNIST files, any usual layout (default: %(default)s)",
    )
    p.add_argument("--work", help="where to build the data and runs (default: a temporary folder, removed)")
    p.add_argument("--only", default="pairs,cifar,mnist", help="comma-separated: pairs, cifar, mnist")
    p.add_argument("--augment", default="default", help="comma-separated policies per run (default = no flag)")
    p.add_argument("--weight-decay", default="default", help="comma-separated values per run (default = no flag)")
    p.add_argument("--init", default=str(REPO / "models" / "cifar10"), help="the model to fine-tune in part 2")
    p.add_argument("--pairs-train", type=int, default=3000)
    p.add_argument("--pairs-test", type=int, default=500)
    p.add_argument("--pairs-epochs", type=int, default=30)
    p.add_argument("--cifar-train", type=int, default=1500)
    p.add_argument("--cifar-test", type=int, default=500)
    p.add_argument("--cifar-epochs", type=int, default=3)
    p.add_argument("--mnist-train", type=int, default=5000)
    p.add_argument("--mnist-test", type=int, default=1000)
    p.add_argument("--mnist-epochs", type=int, default=10)
    p.add_argument("--threads", type=int, help="torch threads of each run (OMP_NUM_THREADS)")
    a = p.parse_args()
    parts = [s.strip() for s in a.only.split(",") if s.strip()]
    unknown = set(parts) - {"pairs", "cifar", "mnist"}
    if unknown:
        p.error(f"--only takes pairs, cifar, mnist; got {', '.join(sorted(unknown))}")
    data = Path(a.data)
    if not data.is_dir():
        p.error(f"--data {data} is not a folder")
    if a.threads:
        os.environ["OMP_NUM_THREADS"] = str(a.threads)
    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="bench_own_data_"))
    work.mkdir(parents=True, exist_ok=True)
    results = []
    try:
        for policy, decay in [(p, w) for p in a.augment.split(",") for w in a.weight_decay.split(",")]:
            policy, decay = policy.strip(), decay.strip()
            tag = policy.replace("-", "") + ("" if decay == "default" else f"-wd{decay}")
            # the SGD runs from scratch were measured at a coupled decay of 2e-2 (docs/research/own-data-battery.md)
            sgd_decay = ["--weight-decay", "2e-2"] if decay == "default" else []
            if "pairs" in parts:
                csv_path = work / "pairs" / "pairs.csv"
                if not csv_path.is_file():
                    build_pairs(data, work / "pairs", a.pairs_train, a.pairs_test)
                pairs = [
                    "--model",
                    "multimnist-matrix-small",
                    "--data",
                    str(csv_path),
                    "--set",
                    "image_size=32",
                    "--epochs",
                    str(a.pairs_epochs),
                    "--batch-size",
                    "64",
                    "--optimizer",
                    "sgd",
                    "--lr",
                    "0.05",
                    "--schedule",
                    "onecycle",
                    "--val-size",
                    "0.1",
                    *sgd_decay,
                ]
                results.append(train("pairs", pairs, work / f"run-pairs-{tag}", policy, decay))
            if "cifar" in parts:
                folder = work / "cifar64"
                if not folder.is_dir():
                    build_cifar_folder(data, folder, a.cifar_train, a.cifar_test)
                common = ["--data", str(folder), "--epochs", str(a.cifar_epochs), "--batch-size", "32"]
                tune = ["--init", a.init, *common, "--optimizer", "sgd", "--lr", "0.02", "--schedule", "cosine"]
                results.append(
                    train(
                        "cifar fine-tune, frozen backbone",
                        [*tune, "--freeze", "backbone"],
                        work / f"run-cifar-frozen-{tag}",
                        policy,
                        decay,
                    )
                )
                results.append(train("cifar fine-tune", tune, work / f"run-cifar-ft-{tag}", policy, decay))
                scratch = [
                    "--model",
                    "cifar10-simple",
                    *common,
                    "--optimizer",
                    "sgd",
                    "--lr",
                    "0.1",
                    "--schedule",
                    "onecycle",
                    *sgd_decay,
                ]
                results.append(train("cifar from scratch", scratch, work / f"run-cifar-scratch-{tag}", policy, decay))
            if "mnist" in parts:
                folder = work / "mnist"
                if not folder.is_dir():
                    build_mnist_folder(data, folder, a.mnist_train, a.mnist_test)
                results.append(
                    train(
                        "mnist",
                        [
                            "--model",
                            "multimnist-matrix-small",
                            "--data",
                            str(folder),
                            "--image-size",
                            "32",
                            "--epochs",
                            str(a.mnist_epochs),
                            "--batch-size",
                            "64",
                            "--optimizer",
                            "sgd",
                            "--lr",
                            "0.05",
                            "--schedule",
                            "onecycle",
                            *sgd_decay,
                        ],
                        work / f"run-mnist-{tag}",
                        policy,
                        decay,
                    )
                )
    finally:
        if not a.work:
            shutil.rmtree(work, ignore_errors=True)
    print("\n" + json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
