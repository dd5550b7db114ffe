"""A checkpoint's logits and metrics on a split, per routing iteration count, one batch of images in memory at a
time; and threshold calibration on its validation split."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from capserve.data.builtin import load_validation
from capserve.data.own import (
    FailureLog,
    Manifest,
    Sample,
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
from capserve.evaluate.metrics import fit_thresholds, metrics
from capserve.model.checkpoint import update_config
from capserve.model.factory import Model, load
from capserve.routing.fused import without_fused_kernel

# Below this many image runs (images × routing iteration counts) an evaluation routes eagerly: compiling the fused
# attention kernel costs seconds per block shape, which a short evaluation never pays back (docs/routing.md).
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
    update_config(checkpoint, model.config)


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
