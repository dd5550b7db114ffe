"""``capserve evaluate CHECKPOINT --data DIR|CSV``: metrics per routing iteration count as a table, JSON or plots
(docs/training.md)."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

import torch

from capserve.configs import ModelConfig
from capserve.data.builtin import dataset_for, load_test, load_validation
from capserve.data.own import Manifest, check_data_exists, check_labels, is_own_data, scan
from capserve.evaluate.evaluator import calibrate, evaluate, evaluate_own, own_samples
from capserve.evaluate.metrics import by_label, metrics
from capserve.evaluate.plots import COUNTED_LABELS, plot_confusion, plot_iterations
from capserve.model.checkpoint import CONFIG
from capserve.model.factory import load

# the most frequent confusions printed in place of a matrix too wide for a terminal (``COUNTED_LABELS``)
PRINTED_CONFUSIONS = 10

log = logging.getLogger(__name__)


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
        help="routing iteration counts, comma-separated, e.g. 1,2,3,4,5 for the paper's accuracy-per-T analysis "
        "(default: the count the model was trained with; CNN baselines have no routing and take none)",
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
    """The T to evaluate: ``given``, or the model's own (one pass over the images: an evaluation costs less than a
    training epoch); [None] for a CNN, which has no routing (and refuses a given list)."""
    if config.has_routing:
        return list(given or [config.iterations])
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
    if is_own_data(args.data):
        results, dataset, images, skipped = evaluate_own_data(args, model, iterations, checkpoint)
    else:
        results, dataset, images = evaluate_builtin(args, model, iterations)
        skipped = 0
    results = {T: by_label(r, c.labels) for T, r in results.items()}
    report = {
        "model": str(c.extra.get("name") or c.name),  # the name the server answers with (``--name``)
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
    if args.out:
        write_outputs(Path(args.out), report, results, c, iterations, args.split)
    if args.json:
        print(json.dumps(report))
        return 0
    print_results(report, results, c, iterations)
    return 0


def evaluate_own_data(
    args: argparse.Namespace, model: Any, iterations: list[int | None], checkpoint: Path
) -> tuple[dict[int | None, dict[str, Any]], str, int, int]:
    """Metrics per T on the ``--split`` of the user's folder or CSV (every image when it names no splits), checked
    against the model's labels; with the data's kind, the images evaluated and the unreadable ones skipped."""
    c = model.config
    manifest = scan(args.data, args.label_separator)
    samples = own_samples(manifest, args.split, c.extra.get("data", {}).get("val_size"))[: args.limit]
    check_labels(
        Manifest(manifest.source, manifest.kind, {"train": [], args.split: samples}, True),
        c.labels,
        f"the model's labels ({checkpoint})",
        (args.split,),
    )
    logits, targets, skipped = evaluate_own(model, samples, manifest.source, iterations, args.batch_size, args.device)
    return {T: metrics(c, logits[T], targets) for T in iterations}, manifest.kind, len(targets), skipped


def evaluate_builtin(
    args: argparse.Namespace, model: Any, iterations: list[int | None]
) -> tuple[dict[int | None, dict[str, Any]], str, int]:
    """Metrics per T on the ``--split`` of the built-in dataset the model was trained on; with its name and the
    images evaluated."""
    c = model.config
    info = c.extra.get("data", {})
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
    return evaluate(model, split, iterations, args.batch_size, args.device), dataset, len(split)


def headline(
    results: dict[int | None, dict[str, Any]], c: ModelConfig, iterations: list[int | None]
) -> tuple[str, Any]:
    """The main metric's name and the metrics shown per label: at the trained T, else at the last T evaluated."""
    trained_T = c.iterations if c.has_routing else None
    key = "exact_match" if c.task == "multi_label" else "top1"
    return key, results.get(trained_T, results[iterations[-1]])


def write_outputs(
    out: Path,
    report: dict[str, Any],
    results: dict[int | None, dict[str, Any]],
    c: ModelConfig,
    iterations: list[int | None],
    split: str,
) -> None:
    """evaluation.json, the main metric against T (with routing) and the confusion matrix (single-label)."""
    key, main = headline(results, c, iterations)
    trained_T = report["trained_iterations"]
    out.mkdir(parents=True, exist_ok=True)
    (out / "evaluation.json").write_text(json.dumps(report, indent=1) + "\n")
    if c.has_routing:
        plot_iterations(results, key, out / "iterations.png", f"{c.name}: {split} {key} vs T")
    if c.task == "single_label":
        T = trained_T if trained_T in results else iterations[-1]
        at = "" if T is None else f", T = {T}"
        plot_confusion(main["confusion"], c.labels, out / "confusion.png", f"{c.name}: {split}{at}")


def print_results(
    report: dict[str, Any], results: dict[int | None, dict[str, Any]], c: ModelConfig, iterations: list[int | None]
) -> None:
    """The metrics per T as a table, then per label: F1 (multi-label), or precision, recall, F1 and the confusion
    matrix."""
    key, main = headline(results, c, iterations)
    tops = [k for k in results[iterations[0]] if k.startswith("top") and k != "top1"]
    second = "macro_f1" if c.task == "multi_label" else tops[0]
    third = ["ranked_recall"] if c.task == "multi_label" else []
    skipped, trained_T = report["skipped_images"], report["trained_iterations"]
    skipped_note = f", {skipped} unreadable skipped" if skipped else ""
    trained = f"trained with T = {trained_T}" if c.has_routing else f"a CNN ({c.head} head): no routing iterations"
    print(f"{c.name} on {report['dataset']} {report['split']} ({report['images']} images{skipped_note}; {trained})")
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
        print_confusion(main["confusion"], c.labels, width)


def print_confusion(confusion: list[list[int]], labels: tuple[str, ...], width: int) -> None:
    """The confusion matrix, whole up to ``COUNTED_LABELS`` labels; beyond, its most frequent confusions (the whole
    matrix is evaluation.json's and confusion.png's, with ``--out``)."""
    if len(labels) <= COUNTED_LABELS:
        print("confusion matrix (rows true, columns predicted):")
        for lab, row in zip(labels, confusion, strict=True):
            print(f"{lab:>{width}} " + " ".join(f"{v:5d}" for v in row))
        return
    counts = torch.tensor(confusion).fill_diagonal_(0)  # (C, C), only the mistakes
    top = counts.flatten().topk(min(PRINTED_CONFUSIONS, counts.numel()))
    pairs = [
        (divmod(i, len(labels)), n) for i, n in zip(top.indices.tolist(), top.values.tolist(), strict=True) if n > 0
    ]
    print(
        f"most frequent confusions of {len(labels)} labels (the whole matrix: --out DIR writes evaluation.json and "
        "confusion.png):" + ("" if pairs else " none")
    )
    for (true, predicted), n in pairs:
        print(f"{labels[true]:>{width}} taken for {labels[predicted]}: {n} image{'s' * (n != 1)}")
