"""The images an INT8 export calibrates on and the held-out images its gate scores, from a user's folder or CSV
(``capserve train --data`` layout) or a built-in dataset's folder, decoded and normalised as training and the
service do (docs/int8.md)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from capserve.configs import ModelConfig
from capserve.data.builtin import dataset_for, load_training
from capserve.data.multimnist import multimnist
from capserve.data.own import FailureLog, Sample, check_labels, decode_all, draw, is_own_data, scan, targets_for
from capserve.data.preprocess import normalize_images
from capserve.errors import ExportError

DEFAULT_IMAGES = 512  # calibration images
GATE_IMAGES = 1000  # held-out images the gate scores (at most)


@dataclass
class CalibrationSet:
    """Normalised images (N, C, H, W) float32 to calibrate on, and held-out images with targets for the gate."""

    images: np.ndarray  # (N, C, H, W)
    held_out: np.ndarray  # (M, C, H, W)
    targets: np.ndarray | None  # (M,) class indices, or (M, C) multi-hot; None when the held-out images have no labels
    source: str
    split: str  # where the held-out images came from
    stratified: bool
    pixels: np.ndarray  # (N, C, H, W) uint8: ``images`` before normalisation (the int8 graph records a few)


def decode(samples: list[Sample], config: ModelConfig, source: Path, desc: str) -> tuple[np.ndarray, list[int]]:
    """uint8 (N, C, H, W) of ``samples`` and the indices of the readable ones (``desc``: what they are)."""
    failures = FailureLog(len(samples), source)
    images, kept = decode_all(samples, config, failures, desc)
    failures.check()
    if not kept:
        raise ExportError(f"no readable {desc} in {source}")
    return images, kept


def own_data(path: Path, config: ModelConfig, count: int, gate_images: int) -> CalibrationSet:
    """Calibration images drawn from the training split (stratified by label when it can); the gate's from the
    test split, else the val split, else the training images calibration did not use."""
    manifest = scan(path)
    check_labels(manifest, config.labels, "the model's labels", ("train", "val", "test"))
    train = manifest.splits["train"] or [s for split in manifest.splits.values() for s in split]
    single = manifest.task == "single_label"
    count = min(count, len(train))
    if count < len(train):
        rest, chosen, stratified = draw(train, count, single)
    else:
        rest, chosen, stratified = [], list(range(len(train))), single and all(len(s.labels) == 1 for s in train)
    held, split = next(
        ((manifest.splits[s], s) for s in ("test", "val") if manifest.splits.get(s)),
        ([train[i] for i in rest], "train images not used for calibration"),
    )
    if len(held) > gate_images:  # a seeded draw, every label in its share: a folder's scan order is by label
        held = [held[i] for i in sorted(draw(held, gate_images, single)[1])]
    calibration, _ = decode([train[i] for i in chosen], config, manifest.source, "calibration images")
    targets = None
    held_out = np.zeros((0, *calibration.shape[1:]), np.uint8)
    if held:
        held_out, kept = decode(held, config, manifest.source, "held-out images")
        if all(s.labels for s in held) or config.task == "multi_label":
            targets = targets_for([held[i] for i in kept], config.labels, config.task == "multi_label").numpy()
    return CalibrationSet(
        normalize_images(calibration, config),
        normalize_images(held_out, config),
        targets,
        str(path),
        split,
        stratified,
        calibration,
    )


def round_robin(targets: np.ndarray, classes: int, seed: int = 0) -> np.ndarray:
    """Indices of ``targets`` (N,) in an order that takes one image of each class in turn, each class's own order
    seeded: any prefix is stratified."""
    rng = np.random.default_rng(seed)
    per_class = [rng.permutation(np.flatnonzero(targets == c)) for c in range(classes)]
    rank = np.concatenate([np.arange(len(p)) for p in per_class])  # each image's turn within its class
    return np.concatenate(per_class)[np.argsort(rank, kind="stable")]


def builtin(path: Path, config: ModelConfig, count: int, gate_images: int) -> CalibrationSet:
    """CIFAR-10/100 or DiverseMultiMNIST from its own files: calibration from the training part, the gate on the
    validation split the model's training carved (``val_size`` recorded in its config; 5,000 by default)."""
    dataset = config.extra.get("data", {}).get("dataset") or dataset_for(config.labels, config.task, config.image_size)
    val_size = config.extra.get("data", {}).get("val_size") or 5000
    data = load_training(dataset, path, val_size=val_size)
    if data.train is not None:  # CIFAR: stratified draw
        order = round_robin(data.train.targets.numpy(), config.num_classes)
        calibration, stratified = data.train.images[torch.from_numpy(order[:count])].numpy(), True
    else:  # DiverseMultiMNIST: images drawn from the training digits
        digits, labels = data.digits
        g = torch.Generator().manual_seed(0)
        calibration, stratified = multimnist(digits, labels, count, g).images.numpy(), False
    held = data.val.subset(torch.arange(min(gate_images, len(data.val))))
    return CalibrationSet(
        normalize_images(calibration, config),
        normalize_images(held.images.numpy(), config),
        held.targets.numpy(),
        str(path),
        f"{dataset} validation split",
        stratified,
        calibration,
    )


def read_calibration(
    data: str | Path, config: ModelConfig, count: int = DEFAULT_IMAGES, gate_images: int = GATE_IMAGES
) -> CalibrationSet:
    """Calibration and held-out images for ``config``'s model from a folder/CSV (or a built-in dataset's folder)."""
    if count < 1:
        raise ExportError(f"--calibration-images must be >= 1, got {count}")
    path = Path(data)
    if not path.exists():
        raise ExportError(
            f"--calibration {path} does not exist: pass a folder of label folders or a CSV "
            "(`capserve train --data` layout)"
        )
    if is_own_data(path):
        return own_data(path, config, count, gate_images)
    return builtin(path, config, count, gate_images)
