"""``capserve evaluate CHECKPOINT --data DIR|CSV``: accuracy per routing iteration count, on one checkpoint.

Single-label: top-1/top-5, per-class precision/recall/F1 and the confusion matrix. Multi-label: exact match (every
decision right) and per-class F1, with the checkpoint's thresholds (0.5 where none are stored), and the ranked
recall, which needs no threshold: of an image's k labels, the share among its k highest scores (k / classes by
chance). Every metric is
computed for T = 1..5 routing iterations (``--iterations``), the paper's Figure 4 analysis, as a table and a plot;
``--json`` prints the report as one JSON object instead, ``--out DIR`` also writes ``evaluation.json``,
``iterations.png`` and (single-label) ``confusion.png`` with the label names. A baseline CNN has no routing: it is
evaluated once (its row's T is "-", ``--iterations`` is refused, no ``iterations.png``).

``--data`` is the built-in dataset's folder (its test split) or your own images: a folder (``test/`` when it has
one, else every image) or a CSV (its ``test`` rows when it has a split column, else every row). Images are decoded
by ``capserve.data.images`` (the service's preprocessing) one batch at a time and every T runs on that batch before the
next is decoded, so memory holds one batch of images and the (N, C) logits, however many images there are.

``--calibrate`` (multi-label): per-class thresholds that maximise each class's F1 on the *validation* split (the one
training carved, rebuilt from the checkpoint's recorded ``val_size``), stored in the checkpoint's config
(``ModelConfig.thresholds``); the test set is then evaluated with them. Training on your own multi-label data
already does this at its end.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from capserve.configs import ModelConfig
from capserve.data.builtin import dataset_for, load_test, load_validation
from capserve.data.own import (
    FailureLog,
    Manifest,
    Sample,
    check_data_exists,
    check_labels,
    is_own_data,
    iter_decoded,
    scan,
    targets_for,
    with_validation,
)
from capserve.data.preprocess import normalize
from capserve.data.progress import progress_bar
from capserve.data.splits import Split
from capserve.errors import DataError
from capserve.model.checkpoint import CONFIG, save_model
from capserve.model.factory import Model, load
from capserve.plots import plot_confusion, plot_iterations
from capserve.routing.fused import without_fused_kernel
from capserve.runtime.outputs import labels_passed, multi_label_decisions, sigmoid

log = logging.getLogger(__name__)


THRESHOLD_GRID = tuple(round(0.05 * i, 2) for i in range(1, 20))  # 0.05 … 0.95


# Below this many image runs (images × routing iteration counts) an evaluation routes eagerly: compiling the fused
# attention kernel costs seconds per block shape (a full batch and the last, shorter one), which 500 test images at
# T = 1..3 never pay back (measured: the compile was half of such an evaluation's time); a full CIFAR-10 test set
# at T = 1..5 (50,000) does.
FUSED_MIN_IMAGE_RUNS = 20_000


@torch.no_grad()
def predict_batches(
    model: Model,
    batches: Iterable[Tensor],
    iterations: Sequence[int | None],
    device: str | torch.device = "cpu",
    images: int | None = None,
) -> dict[int | None, Tensor]:
    """Logits (N, C) float32 on the CPU per routing iteration count, from uint8 image batches (b, C, H, W).

    Each batch runs at every T before the next is read, so a streaming ``batches`` keeps one batch in memory.
    ``images``: how many images ``batches`` holds, when known; too few to pay for compiling the fused routing kernel
    (``FUSED_MIN_IMAGE_RUNS``) and they route eagerly.
    """
    short = images is not None and images * len(iterations) < FUSED_MIN_IMAGE_RUNS
    with without_fused_kernel() if short else contextlib.nullcontext():
        return _predict_batches(model, batches, iterations, device)


def _predict_batches(
    model: Model, batches: Iterable[Tensor], iterations: Sequence[int | None], device: str | torch.device
) -> dict[int | None, Tensor]:
    model.eval()
    c = model.config
    out: dict[int | None, list[Tensor]] = {T: [] for T in iterations}
    for images in batches:
        if not len(images):
            continue
        x = normalize(images.to(device), c.mean, c.std)  # (b, C, H, W)
        for T in iterations:
            out[T].append(model(x, iterations=T).float().cpu())  # (b, classes)
    return {T: torch.cat(v) if v else torch.zeros(0, c.num_classes) for T, v in out.items()}


def _slices(split: Split, batch_size: int, desc: str | None = None) -> Iterator[Tensor]:
    with progress_bar(len(split), desc) if desc else contextlib.nullcontext() as bar:
        for start in range(0, len(split), batch_size):
            yield split.images[start : start + batch_size]
            if bar is not None:
                bar.update(min(batch_size, len(split) - start))


def predict_logits(
    model: Model, split: Split, iterations: int | None = None, batch_size: int = 250, device: str | torch.device = "cpu"
) -> Tensor:
    """Logits (N, C) float32 on the CPU for every image of ``split`` after ``iterations`` routing iterations."""
    return predict_batches(model, _slices(split, batch_size), [iterations], device, len(split))[iterations]


def single_label_metrics(logits: Tensor, targets: Tensor) -> dict[str, Any]:
    """Top-1, top-5 (top-k for fewer than 5 classes), per-class precision/recall/F1/support and the confusion
    matrix (rows: true, columns: predicted); a class never predicted (or never present) scores 0."""
    C = logits.shape[1]
    k = min(5, C)
    top = logits.topk(k, dim=1).indices  # (N, k)
    confusion = torch.bincount(targets * C + top[:, 0], minlength=C * C).view(C, C)  # (C, C)
    tp = confusion.diag().double()
    precision = tp / confusion.sum(0).clamp_min(1)
    recall = tp / confusion.sum(1).clamp_min(1)
    f1 = 2 * tp / (confusion.sum(0) + confusion.sum(1)).clamp_min(1)
    return {
        "top1": (top[:, 0] == targets).float().mean().item(),
        f"top{k}": (top == targets[:, None]).any(dim=1).float().mean().item(),
        "precision": precision.tolist(),
        "recall": recall.tolist(),
        "f1": f1.tolist(),
        "support": confusion.sum(1).tolist(),
        "macro_f1": f1.mean().item(),
        "confusion": confusion.tolist(),
    }


def multi_label_metrics(logits: Tensor, targets: Tensor, thresholds: tuple[float, ...] | None) -> dict[str, Any]:
    """Exact match (every class decided right) and per-class F1, with the server's decision rule
    (``capserve.runtime.outputs.multi_label_decisions``: probability at or above the threshold)."""
    pred = torch.from_numpy(multi_label_decisions(logits.numpy(), thresholds))  # (N, C)
    truth = targets > 0.5  # (N, C)
    f1 = _f1(pred, truth)
    return {
        "exact_match": (pred == truth).all(dim=1).float().mean().item(),
        "f1": f1.tolist(),
        "macro_f1": f1.mean().item(),
        "ranked_recall": ranked_recall(logits, truth),
    }


def ranked_recall(logits: Tensor, truth: Tensor) -> float:
    """Of each image's k labels, the share among its k highest logits, over all labels of all images (threshold-free:
    it shows whether a model ranks the right labels first before its activations cross any threshold)."""
    k = truth.sum(1, keepdim=True)  # (N, 1)
    rank = logits.argsort(dim=1, descending=True).argsort(dim=1)  # (N, C): 0 for the highest logit
    return ((rank < k) & truth).sum().item() / max(k.sum().item(), 1)


def _f1(pred: Tensor, truth: Tensor) -> Tensor:
    tp = (pred & truth).sum(0).float()
    fp = (pred & ~truth).sum(0).float()
    fn = (~pred & truth).sum(0).float()
    return 2 * tp / (2 * tp + fp + fn).clamp_min(1)  # (C,)


def fit_thresholds(logits: Tensor, targets: Tensor, grid: tuple[float, ...] = THRESHOLD_GRID) -> tuple[float, ...]:
    """Per class, the grid threshold with the best F1 on these (validation) logits; ties go to the value nearest 0.5.

    A class whose best F1 is no better than answering it for every image (what a low threshold does on a model that
    has not learnt it) keeps 0.5: calibration must not turn "no signal" into "always yes"."""
    probs, truth = sigmoid(logits.numpy()), targets > 0.5
    g = torch.tensor(grid, dtype=torch.float64)  # the stored values exactly: a tie scores as evaluation decides
    scores = torch.stack([_f1(torch.from_numpy(labels_passed(probs, float(t))), truth) for t in g])  # (G, C)
    always = _f1(torch.ones_like(truth), truth)  # (C,): the F1 of answering every label for every image
    best = []
    for c in range(scores.shape[1]):
        if scores[:, c].max() <= always[c] + 1e-9:
            best.append(0.5)
            continue
        top = scores[:, c] >= scores[:, c].max() - 1e-12
        candidates = g[top]
        best.append(round(float(candidates[(candidates - 0.5).abs().argmin()]), 4))
    return tuple(best)


PER_LABEL = ("precision", "recall", "f1", "support")  # per-class lists in the metrics, keyed by label in reports


def by_label(metrics: dict[str, Any], labels: Sequence[str]) -> dict[str, Any]:
    """The metrics with each per-class list as {label: value} (the order of ``labels``): a report read by a script
    must not depend on knowing the label order. The confusion matrix stays a matrix in the order of ``labels``."""
    return {k: dict(zip(labels, v, strict=True)) if k in PER_LABEL else v for k, v in metrics.items()}


def metrics(config: Any, logits: Tensor, targets: Tensor) -> dict[str, Any]:
    if config.task == "multi_label":
        return multi_label_metrics(logits, targets, config.thresholds)
    return single_label_metrics(logits, targets)


def evaluate(
    model: Model, split: Split, iterations: list[int], batch_size: int = 250, device: str | torch.device = "cpu"
) -> dict[int, dict[str, Any]]:
    """Metrics of ``model`` on ``split`` for each routing iteration count in ``iterations``."""
    logits = predict_batches(model, _slices(split, batch_size, "evaluating"), iterations, device, len(split))
    return {T: metrics(model.config, logits[T], split.targets) for T in iterations}


def own_samples(manifest: Manifest, split: str, val_size: int | float | None) -> list[Sample]:
    """The images of a user's data to evaluate: ``test`` (all of it when the data names no splits) or ``val``."""
    if split == "test":
        if not manifest.named_splits:
            return [s for samples in manifest.splits.values() for s in samples]
        if not manifest.splits.get("test"):
            raise DataError(
                f"{manifest.source} has no test split (a test/ folder, or rows with split test); use "
                "--split val, or point --data at the test images alone"
            )
        return manifest.splits["test"]
    if not manifest.splits.get("val") and val_size is None:
        raise DataError(f"{manifest.source} has no val split and the model records no --val-size to carve one")
    val = with_validation(manifest, val_size)[0].splits["val"]
    if not val:
        raise DataError(f"{manifest.source}: the validation split is empty (trained with --val-size 0?)")
    return val


def evaluate_own(
    model: Model,
    samples: Sequence[Sample],
    source: Path,
    iterations: Sequence[int | None],
    batch_size: int = 250,
    device: str | torch.device = "cpu",
) -> tuple[dict[int | None, Tensor], Tensor, int]:
    """Logits per T, targets and the number of skipped files for a user's images, decoded one batch at a time."""
    c = model.config
    failures = FailureLog(len(samples), source)
    kept: list[int] = []

    def batches() -> Iterator[Tensor]:
        for images, index in iter_decoded(samples, c, failures, batch_size, desc="evaluating"):
            kept.extend(index)
            yield torch.from_numpy(images)

    logits = predict_batches(model, batches(), iterations, device, len(samples))
    failures.check()
    if not kept:
        raise DataError(f"no readable images to evaluate in {source}")
    return logits, targets_for([samples[i] for i in kept], c.labels, c.task == "multi_label"), len(failures.failures)


def store_thresholds(checkpoint: Path, model: Model, thresholds: Sequence[float]) -> None:
    """Write per-class thresholds into the checkpoint's config.json, keeping its other entries."""
    model.config = dataclasses.replace(model.config, thresholds=tuple(thresholds))
    payload = json.loads((checkpoint / CONFIG).read_text())
    extra = {k: v for k, v in payload.items() if k not in ("format_version", "config")}
    save_model(model, checkpoint, extra=extra)


def calibrate(
    checkpoint: str | Path,
    data: str | Path,
    batch_size: int = 250,
    device: str | torch.device = "cpu",
    label_separator: str | None = None,
) -> tuple[float, ...]:
    """Fit per-class thresholds on the checkpoint's validation split and store them in its config.json."""
    checkpoint = Path(checkpoint)
    model = load(checkpoint, device)
    c = model.config
    if c.task != "multi_label":
        raise ValueError(f"--calibrate is for multi-label models; {c.name} is {c.task}")
    info = c.extra.get("data", {})
    if is_own_data(data):
        manifest = scan(data, label_separator)
        check_labels(manifest, c.labels, "the model's labels", ("val",))
        samples = own_samples(manifest, "val", info.get("val_size"))
        logits, targets, _ = evaluate_own(model, samples, manifest.source, [None], batch_size, device)
        thresholds = fit_thresholds(logits[None], targets)
    else:
        if not info.get("val_size"):
            raise ValueError(
                f"{checkpoint}: no validation split recorded (trained with --val-size 0?); cannot calibrate"
            )
        val = load_validation(info["dataset"], data, info["val_size"])
        thresholds = fit_thresholds(predict_logits(model, val, None, batch_size, device), val.targets)
    store_thresholds(checkpoint, model, thresholds)
    return thresholds


DEFAULT_ITERATIONS = (1, 2, 3, 4, 5)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="model folder (config.json + model.safetensors), e.g. RUN/best")
    p.add_argument(
        "--data",
        required=True,
        help="your images (a label-folder tree or a CSV: its test split, or "
        "everything when it names no splits), or the folder with the CIFAR/MNIST files",
    )
    p.add_argument(
        "--label-separator",
        metavar="SEP",
        help="a CSV's labels column: labels separated by SEP (default: spaces), as in training",
    )
    p.add_argument(
        "--iterations",
        help="routing iteration counts, comma-separated (default 1,2,3,4,5; CNN "
        "baselines have no routing and take none)",
    )
    p.add_argument("--split", choices=("test", "val"), default="test")
    p.add_argument("--limit", type=int, help="evaluate only the first N images")
    p.add_argument("--batch-size", type=int, default=250)
    p.add_argument("--device", default="cpu")
    p.add_argument("--calibrate", action="store_true", help="multi-label: fit thresholds on validation, store them")
    p.add_argument("--json", action="store_true", help="print the metrics as one JSON object (nothing else)")
    p.add_argument("--out", help="folder for evaluation.json and the plots")


def parse_iterations(text: str | None) -> list[int] | None:
    """``--iterations`` → sorted T values (None when not given)."""
    if text is None:
        return None
    try:
        iterations = sorted({int(t) for t in text.split(",") if t.strip()})
    except ValueError:
        raise ValueError(f"--iterations takes integers like 1,2,3, got {text!r}") from None
    if not iterations or iterations[0] < 1:
        raise ValueError(f"--iterations must be integers >= 1, got {text!r}")
    return iterations


def iterations_for(config: ModelConfig, given: list[int] | None) -> list[int | None]:
    """The T to evaluate: ``given`` or 1..5; [None] for a CNN, which has no routing (and refuses a given list)."""
    if config.has_routing:
        return list(given or DEFAULT_ITERATIONS)
    if given is not None:
        raise ValueError(
            f"{config.name} is a CNN (head {config.head!r}) without routing: --iterations does not apply; drop it"
        )
    return [None]


def run(args: argparse.Namespace) -> int:
    given = parse_iterations(args.iterations)  # a malformed list fails before any work
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}")
    checkpoint = Path(args.checkpoint)
    if not (checkpoint / CONFIG).is_file():
        raise FileNotFoundError(f"{checkpoint} is not a model folder ({CONFIG} missing); pass e.g. RUN/best")
    check_data_exists(args.data)
    if args.calibrate:
        thresholds = calibrate(checkpoint, args.data, args.batch_size, args.device, args.label_separator)
        log.info(
            "calibrated thresholds on the validation split (stored in %s): %s",
            checkpoint / CONFIG,
            ", ".join(f"{t:.2f}" for t in thresholds),
        )
    model = load(checkpoint, args.device)
    c = model.config
    iterations = iterations_for(c, given)
    trained_T = c.iterations if c.has_routing else None
    info = c.extra.get("data", {})
    skipped = 0
    if is_own_data(args.data):
        manifest = scan(args.data, args.label_separator)
        dataset = manifest.kind
        samples = own_samples(manifest, args.split, info.get("val_size"))[: args.limit]
        check_labels(
            Manifest(manifest.source, manifest.kind, {"train": [], args.split: samples}, True),
            c.labels,
            f"the model's labels ({checkpoint})",
            (args.split,),
        )
        logits, targets, skipped = evaluate_own(
            model, samples, manifest.source, iterations, args.batch_size, args.device
        )
        results = {T: metrics(c, logits[T], targets) for T in iterations}
        images = len(targets)
    else:
        dataset = info.get("dataset") or dataset_for(c.labels, c.task, c.image_size)
        if dataset in ("folder", "csv"):
            raise FileNotFoundError(
                f"{c.name} was trained on your own images ({info.get('source')}); pass a folder "
                f"or CSV of such images as --data, not {args.data}"
            )
        if args.split == "test":
            split = load_test(dataset, args.data)
        else:
            split = load_validation(dataset, args.data, info.get("val_size", 5000))
        if args.limit:
            split = split.subset(torch.arange(min(args.limit, len(split))))
        results = evaluate(model, split, iterations, args.batch_size, args.device)
        images = len(split)
    key = "exact_match" if c.task == "multi_label" else "top1"
    results = {T: by_label(r, c.labels) for T, r in results.items()}
    report = {
        "model": c.name,
        "checkpoint": str(checkpoint),
        "data": str(args.data),
        "dataset": dataset,
        "split": args.split,
        "images": images,
        "skipped_images": skipped,
        "task": c.task,
        "labels": list(c.labels),
        "trained_iterations": trained_T,
        "thresholds": c.thresholds,
        "results": {"none" if T is None else T: r for T, r in results.items()},
    }
    main = results.get(trained_T, results[iterations[-1]])
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "evaluation.json").write_text(json.dumps(report, indent=1) + "\n")
        if c.has_routing:
            plot_iterations(results, key, out / "iterations.png", f"{c.name}: {args.split} {key} vs T")
        if c.task == "single_label":
            T = trained_T if trained_T in results else iterations[-1]
            at = "" if T is None else f", T = {T}"
            plot_confusion(main["confusion"], c.labels, out / "confusion.png", f"{c.name}: {args.split}{at}")
    if args.json:
        print(json.dumps(report))
        return 0
    tops = [k for k in results[iterations[0]] if k.startswith("top") and k != "top1"]
    second = "macro_f1" if c.task == "multi_label" else tops[0]
    third = ["ranked_recall"] if c.task == "multi_label" else []
    skipped_note = f", {skipped} unreadable skipped" if skipped else ""
    trained = f"trained with T = {trained_T}" if c.has_routing else f"a CNN ({c.head} head): no routing iterations"
    print(f"{c.name} on {dataset} {args.split} ({images} images{skipped_note}; {trained})")
    print(f"{'T':>3} {key:>12} {second:>10}" + "".join(f" {name:>14}" for name in third))
    for T in iterations:
        print(
            f"{'-' if T is None else T:>3} {100 * results[T][key]:11.2f}% {100 * results[T][second]:9.2f}%"
            + "".join(f" {100 * results[T][name]:13.2f}%" for name in third)
        )
    width = max(10, *(len(lab) for lab in c.labels))
    if c.task == "multi_label":
        print("per-class F1: " + ", ".join(f"{lab} {main['f1'][lab]:.3f}" for lab in c.labels))
    else:
        print(f"{'label':>{width}} {'precision':>9} {'recall':>7} {'F1':>6} {'images':>7}")
        for lab in c.labels:
            print(
                f"{lab:>{width}} {main['precision'][lab]:9.3f} {main['recall'][lab]:7.3f} {main['f1'][lab]:6.3f} "
                f"{main['support'][lab]:7d}"
            )
        print("confusion matrix (rows true, columns predicted):")
        for lab, row in zip(c.labels, main["confusion"], strict=True):
            print(f"{lab:>{width}} " + " ".join(f"{v:5d}" for v in row))
    return 0
