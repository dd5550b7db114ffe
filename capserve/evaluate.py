"""``capserve evaluate CHECKPOINT --data DIR``: accuracy per routing iteration count, on one checkpoint.

Single-label: top-1/top-5 and the confusion matrix. Multi-label (DiverseMultiMNIST): exact match (all 10 decisions
right) and per-class F1, with the checkpoint's thresholds (0.5 where none are stored). Every metric is computed for
T = 1..5 routing iterations (``--iterations``), the paper's Figure 4 analysis, as a table and a plot.

``--calibrate`` (multi-label): per-class thresholds that maximise each class's F1 on the *validation* split (the one
training carved, rebuilt from the checkpoint's recorded ``val_size``), stored in the checkpoint's config
(``ModelConfig.thresholds``); the test set is then evaluated with them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from capserve.checkpoint import CONFIG, load, save_model
from capserve.data import Split, dataset_for, load_test, load_validation
from capserve.model import CapsNet
from capserve.preprocess import normalize

log = logging.getLogger(__name__)

THRESHOLD_GRID = tuple(round(0.05 * i, 2) for i in range(1, 20))  # 0.05 … 0.95


@torch.no_grad()
def predict_logits(model: CapsNet, split: Split, iterations: int | None = None, batch_size: int = 250,
                   device: str | torch.device = "cpu") -> Tensor:  # fmt: skip
    """Logits (N, C) float32 on the CPU for every image of ``split`` after ``iterations`` routing iterations."""
    model.eval()
    c = model.config
    out = []
    for start in range(0, len(split), batch_size):
        x = normalize(split.images[start : start + batch_size].to(device), c.mean, c.std)
        out.append(model(x, iterations=iterations).float().cpu())  # (b, C)
    return torch.cat(out) if out else torch.zeros(0, c.num_classes)


def single_label_metrics(logits: Tensor, targets: Tensor) -> dict[str, Any]:
    """Top-1, top-5 (top-k for fewer than 5 classes) and the confusion matrix (rows: true, columns: predicted)."""
    C = logits.shape[1]
    k = min(5, C)
    top = logits.topk(k, dim=1).indices  # (N, k)
    confusion = torch.bincount(targets * C + top[:, 0], minlength=C * C).view(C, C)
    return {"top1": (top[:, 0] == targets).float().mean().item(),
            f"top{k}": (top == targets[:, None]).any(dim=1).float().mean().item(),
            "confusion": confusion.tolist()}  # fmt: skip


def multi_label_metrics(logits: Tensor, targets: Tensor, thresholds: tuple[float, ...] | None) -> dict[str, Any]:
    """Exact match (every class decided right) and per-class F1, deciding ``sigmoid(logit) > threshold``."""
    thr = torch.tensor(thresholds if thresholds is not None else [0.5] * logits.shape[1])
    pred = torch.sigmoid(logits) > thr  # (N, C)
    truth = targets > 0.5  # (N, C)
    f1 = _f1(pred, truth)
    return {"exact_match": (pred == truth).all(dim=1).float().mean().item(), "f1": f1.tolist(),
            "macro_f1": f1.mean().item()}  # fmt: skip


def _f1(pred: Tensor, truth: Tensor) -> Tensor:
    tp = (pred & truth).sum(0).float()
    fp = (pred & ~truth).sum(0).float()
    fn = (~pred & truth).sum(0).float()
    return 2 * tp / (2 * tp + fp + fn).clamp_min(1)  # (C,)


def fit_thresholds(logits: Tensor, targets: Tensor, grid: tuple[float, ...] = THRESHOLD_GRID) -> tuple[float, ...]:
    """Per class, the grid threshold with the best F1 on these (validation) logits; ties go to the value nearest 0.5."""
    probs, truth = torch.sigmoid(logits), targets > 0.5
    g = torch.tensor(grid)
    scores = torch.stack([_f1(probs > t, truth) for t in g])  # (G, C)
    best = []
    for c in range(scores.shape[1]):
        top = scores[:, c] >= scores[:, c].max() - 1e-12
        candidates = g[top]
        best.append(round(float(candidates[(candidates - 0.5).abs().argmin()]), 4))
    return tuple(best)


def evaluate(model: CapsNet, split: Split, iterations: list[int], batch_size: int = 250,
             device: str | torch.device = "cpu") -> dict[int, dict[str, Any]]:  # fmt: skip
    """Metrics of ``model`` on ``split`` for each routing iteration count in ``iterations``."""
    c = model.config
    results = {}
    for T in iterations:
        logits = predict_logits(model, split, T, batch_size, device)
        if c.task == "multi_label":
            results[T] = multi_label_metrics(logits, split.targets, c.thresholds)
        else:
            results[T] = single_label_metrics(logits, split.targets)
    return results


def calibrate(checkpoint: str | Path, data: str | Path, batch_size: int = 250,
              device: str | torch.device = "cpu") -> tuple[float, ...]:  # fmt: skip
    """Fit per-class thresholds on the checkpoint's validation split and store them in its config.json."""
    checkpoint = Path(checkpoint)
    model = load(checkpoint, device)
    c = model.config
    if c.task != "multi_label":
        raise ValueError(f"--calibrate is for multi-label models; {c.name} is {c.task}")
    info = c.extra.get("data", {})
    if not info.get("val_size"):
        raise ValueError(f"{checkpoint}: no validation split recorded (trained with --val-size 0?); cannot calibrate")
    val = load_validation(info["dataset"], data, int(info["val_size"]))
    thresholds = fit_thresholds(predict_logits(model, val, None, batch_size, device), val.targets)
    model.config = dataclasses.replace(c, thresholds=thresholds)
    payload = json.loads((checkpoint / CONFIG).read_text())
    extra = {k: v for k, v in payload.items() if k not in ("format_version", "config")}
    save_model(model, checkpoint, extra=extra)
    return thresholds


def plot_iterations(results: dict[int, dict[str, Any]], key: str, png: Path, title: str) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.info("matplotlib is not installed: skipping %s (pip install 'capserve[train]')", png)
        return None
    Ts = sorted(results)
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(Ts, [100 * results[T][key] for T in Ts], marker="o")
    ax.set_xlabel("routing iterations T")
    ax.set_ylabel(f"{key} (%)")
    ax.set_xticks(Ts)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="model folder (config.json + model.safetensors), e.g. RUN/best")
    p.add_argument("--data", required=True, help="folder with the dataset files (see capserve.data)")
    p.add_argument("--iterations", default="1,2,3,4,5", help="routing iteration counts, comma-separated")
    p.add_argument("--split", choices=("test", "val"), default="test")
    p.add_argument("--limit", type=int, help="evaluate only the first N images")
    p.add_argument("--batch-size", type=int, default=250)
    p.add_argument("--device", default="cpu")
    p.add_argument("--calibrate", action="store_true", help="multi-label: fit thresholds on validation, store them")
    p.add_argument("--out", help="folder for evaluation.json and the plot")


def run(args: argparse.Namespace) -> int:
    try:
        iterations = sorted({int(t) for t in args.iterations.split(",") if t.strip()})
    except ValueError:
        raise ValueError(f"--iterations takes integers like 1,2,3, got {args.iterations!r}") from None
    if not iterations or iterations[0] < 1:
        raise ValueError(f"--iterations must be integers >= 1, got {args.iterations!r}")
    checkpoint = Path(args.checkpoint)
    if not (checkpoint / CONFIG).is_file():
        raise FileNotFoundError(f"{checkpoint} is not a model folder ({CONFIG} missing); pass e.g. RUN/best")
    if args.calibrate:
        thresholds = calibrate(checkpoint, args.data, args.batch_size, args.device)
        print(f"calibrated thresholds on the validation split (stored in {checkpoint / CONFIG}): "
              + ", ".join(f"{t:.2f}" for t in thresholds))  # fmt: skip
    model = load(checkpoint, args.device)
    c = model.config
    dataset = c.extra.get("data", {}).get("dataset") or dataset_for(c.labels, c.task, c.image_size)
    if args.split == "test":
        split = load_test(dataset, args.data)
    else:
        split = load_validation(dataset, args.data, int(c.extra.get("data", {}).get("val_size", 5000)))
    if args.limit:
        split = split.subset(torch.arange(min(args.limit, len(split))))
    results = evaluate(model, split, iterations, args.batch_size, args.device)
    key = "exact_match" if c.task == "multi_label" else "top1"
    tops = [k for k in results[iterations[0]] if k.startswith("top") and k != "top1"]
    second = "macro_f1" if c.task == "multi_label" else tops[0]
    print(f"{c.name} on {dataset} {args.split} ({len(split)} images; trained with T = {c.iterations})")
    print(f"{'T':>3} {key:>12} {second:>10}")
    for T in iterations:
        print(f"{T:>3} {100 * results[T][key]:11.2f}% {100 * results[T][second]:9.2f}%")
    main = results.get(c.iterations, results[iterations[-1]])
    if c.task == "multi_label":
        print("per-class F1: " + ", ".join(f"{lab} {f:.3f}" for lab, f in zip(c.labels, main["f1"], strict=True)))
    else:
        print("confusion matrix (rows true, columns predicted):")
        for lab, row in zip(c.labels, main["confusion"], strict=True):
            print(f"{lab[:10]:>10} " + " ".join(f"{v:5d}" for v in row))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        report = {"model": c.name, "dataset": dataset, "split": args.split, "images": len(split), "results": results}
        (out / "evaluation.json").write_text(json.dumps(report, indent=1) + "\n")
        plot_iterations(results, key, out / "iterations.png", f"{c.name}: {args.split} {key} vs T")
    return 0
