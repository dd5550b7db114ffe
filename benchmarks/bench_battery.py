"""The own-data battery: does ``capserve train`` learn with its defaults on data of kinds nobody tuned it on?

    python benchmarks/bench_battery.py --data data/   # every set, all three learners
    python benchmarks/bench_battery.py --data data/ --only letters,shapes --learners capsules,yardstick

For each set of ``battery_data.BATTERY`` (built once under ``--work``), three learners with the same epochs:

- ``capsules``: ``capserve train --data SET --out RUN --epochs E``, nothing else (the defaults: ``cifar10-conv``);
- ``cnn``: the same command with ``--model cifar10-conv-cnn`` (capserve's CNN baseline: the same backbone, conv
  layers with the capsule layers' neurons, average pooling);
- ``yardstick``: a plain 20-line PyTorch loop (three conv + BatchNorm + ReLU layers, global average pooling, AdamW lr
  2e-3, weight decay 0.05, batch 64, no augmentation, inputs normalised by the training images' mean/std), on the
  very tensors capserve decodes (same input size, same validation split), best epoch chosen on validation.

It prints one table: test top-1 (single-label) or exact match (multi-label) per learner, the prior (always the most
common label, or label set, of the training split), and the seconds each took. ``--extra "ARGS"`` adds a fourth
learner, the capsule command with ARGS appended (e.g. ``--extra "--augment crop-flip"``). ``--seeds 0,1,2`` runs every
learner once per seed (``capserve train --seed S``, the yardstick's own seed) and prints each cell as the mean with the
lowest and highest score; timings are per seed, and noisy on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from battery_data import BATTERY, build
from torch import nn

from capserve.data.cache import build_cache
from capserve.data.own import InputSize, scan, with_validation
from capserve.data.preprocess import data_mean_std
from capserve.hardware import cpu_info
from capserve.runtime.outputs import multi_label_decisions

REPO = Path(__file__).resolve().parents[1]
# short runs, sized for a 2-core CPU (minutes per capsule run there); shapes gets 10 and placed-letters 30
# because at 4 and 5 every learner sat near the prior, and such a row compares nothing
EPOCHS = {
    "letters": 5,
    "textures": 10,
    "cifar5": 4,
    "digits": 2,
    "placed-digits": 3,
    "glyphs": 3,
    "shapes": 10,
    "overlap": 2,
    "placed-letters": 30,
    "arrows": 4,
    "cifar-grey": 4,
    "numbers": 4,
    "letter-tiles": 4,
    "photo-tiles": 6,
    "phone-photos": 6,
    "counts": 5,
    "turned-photos": 6,
    "photo-digits": 12,
    "texture-tiles": 4,
    "photo-blend": 6,
    "letter-blend": 8,
    "few-photos": 20,
    "turned-classes": 6,
    "few-grey-photos": 20,
    "few-counts": 40,
    "few-placed-photos": 20,
    "placed-symbols": 6,
    "placed-photos": 10,
    "placed-faces": 16,
}


def prior(targets: torch.Tensor, multi: bool) -> float:
    """The score of always answering the training split's most common label (or label set)."""
    keys = [tuple(t.tolist()) for t in targets] if multi else targets.tolist()
    return Counter(keys).most_common(1)[0][1] / len(keys)


def score(logits: torch.Tensor, targets: torch.Tensor, multi: bool) -> float:
    if multi:
        decided = torch.from_numpy(multi_label_decisions(logits.numpy(), None))
        return (decided == (targets > 0.5)).all(1).float().mean().item()
    return (logits.argmax(1) == targets).float().mean().item()


def yardstick(data: Path, epochs: int, seed: int = 0) -> dict[str, float]:
    """The plain loop on capserve's own decoding of ``data`` at 32×32 RGB (cifar10-simple's input)."""
    torch.manual_seed(seed)
    manifest, _ = with_validation(scan(data), 0.1)
    labels = sorted({lab for s in manifest.splits["train"] for lab in s.labels})
    own = build_cache(manifest, labels, InputSize(3, 32), None)
    train, val, test = own.splits["train"], own.splits["val"], own.splits["test"]
    multi = manifest.task == "multi_label"
    stats = data_mean_std(train.images)
    mean, std = (torch.tensor(stats[k]).view(1, -1, 1, 1) for k in ("mean", "std"))

    def x(images: torch.Tensor) -> torch.Tensor:
        return (images.float() / 255 - mean) / std

    def block(i: int, o: int) -> list[nn.Module]:
        return [nn.Conv2d(i, o, 3, padding=1, bias=False), nn.BatchNorm2d(o), nn.ReLU(), nn.MaxPool2d(2)]

    net = nn.Sequential(
        *block(3, 64),
        *block(64, 128),
        *block(128, 256),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(256, len(labels)),
    )
    opt = torch.optim.AdamW(net.parameters(), lr=2e-3, weight_decay=0.05)
    loss_fn = nn.BCEWithLogitsLoss() if multi else nn.CrossEntropyLoss()

    def logits_of(split) -> torch.Tensor:  # type: ignore[no-untyped-def]
        net.eval()
        with torch.no_grad():
            out = torch.cat([net(x(split.images[i : i + 500])) for i in range(0, len(split), 500)])
        net.train()
        return out

    best_val, best_state = -1.0, None
    for _ in range(epochs):
        order = torch.randperm(len(train))
        for i in range(0, len(train) - 63, 64):
            b = order[i : i + 64]
            loss = loss_fn(net(x(train.images[b])), train.targets[b])
            opt.zero_grad()
            loss.backward()
            opt.step()
        v = score(logits_of(val), val.targets, multi)
        if v > best_val:
            best_val, best_state = v, {k: t.clone() for k, t in net.state_dict().items()}
    net.load_state_dict(best_state)
    return {"test": score(logits_of(test), test.targets, multi), "val": best_val, "prior": prior(train.targets, multi)}


def capserve_train(data: Path, out: Path, epochs: int, seed: int, extra: list[str]) -> dict[str, float | None]:
    cmd = [
        sys.executable,
        "-m",
        "capserve.cli",
        "train",
        "--data",
        str(data),
        "--out",
        str(out),
        "--epochs",
        str(epochs),
        "--seed",
        str(seed),
        *extra,
    ]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").is_file() else {}
    return {
        "test": summary.get("test_acc"),
        "val": summary.get("best_val_acc"),
        "exit": done.returncode,
        "learned": summary.get("learned"),
    }


def main() -> None:
    print(f"CPU: {cpu_info().describe()}", flush=True)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="data", help="the folder with the MNIST and CIFAR-10 files (default: %(default)s)")
    p.add_argument("--work", help="where the sets and runs go (default: a temporary folder)")
    p.add_argument("--only", help="comma-separated set names (default: all)")
    p.add_argument("--learners", default="capsules,cnn,yardstick")
    p.add_argument("--epochs", type=int, help="the same epochs for every set (default: EPOCHS, per set)")
    p.add_argument("--extra", help="a fourth learner: the capsule command with these arguments appended")
    p.add_argument("--seeds", default="0", help="comma-separated seeds; each learner runs once per seed")
    args = p.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    work = Path(args.work or tempfile.mkdtemp(prefix="battery-"))
    names = args.only.split(",") if args.only else list(BATTERY)
    learners = args.learners.split(",") + (["extra"] if args.extra else [])
    rows = []
    for name in names:
        data = build(name, work / "sets", Path(args.data))
        epochs = args.epochs or EPOCHS[name]
        row: dict[str, object] = {"set": name, "epochs": epochs}
        for learner in learners:
            tests, seconds = [], []
            for seed in seeds:
                t = time.perf_counter()
                if learner == "yardstick":
                    r = yardstick(data, epochs, seed)
                    row["prior"] = r["prior"]
                else:
                    extra = {
                        "capsules": [],
                        "cnn": ["--model", "cifar10-conv-cnn"],
                        "extra": shlex.split(args.extra or ""),
                    }[learner]
                    run = work / "runs" / (f"{name}-{learner}" + (f"-seed{seed}" if len(seeds) > 1 else ""))
                    r = capserve_train(data, run, epochs, seed, extra)
                seconds.append(time.perf_counter() - t)
                tests.append(r["test"])
                report = {"set": name, "learner": learner, "seed": seed, **r, "seconds": round(seconds[-1], 1)}
                print(json.dumps(report), flush=True)
            row[learner] = tests
            row[f"{learner}_s"] = sum(seconds) / len(seconds)
        rows.append(row)
    print(f"\n| set | epochs | prior | {' | '.join(learners)} |")
    print("|---|---:|---:|" + "---:|" * len(learners))
    for row in rows:
        cells = [f"{cell(row[learner])} ({row[f'{learner}_s']:.0f} s)" for learner in learners]  # type: ignore[arg-type]
        prior_text = f"{100 * row['prior']:.1f} %" if "prior" in row else "-"
        print(f"| {row['set']} | {row['epochs']} | {prior_text} | {' | '.join(cells)} |")


def cell(tests: list[float | None]) -> str:
    """One learner's test score on one set: the mean over seeds, with the lowest and highest when there are several."""
    if any(t is None for t in tests):
        return "-"
    mean = 100 * sum(tests) / len(tests)  # type: ignore[arg-type]
    spread = f" ({100 * min(tests):.1f}–{100 * max(tests):.1f})" if len(tests) > 1 else ""  # type: ignore[type-var]
    return f"{mean:.1f} %{spread}"


if __name__ == "__main__":
    main()
