"""Your own images: an image folder (single-label) or a CSV manifest (multi-label), decoded once into a uint8 cache.

``scan`` reads the layout into a ``Manifest`` (docs/training.md has the layouts); ``carve`` draws the validation
split from the file list, so training, ``capserve evaluate --split val`` and INT8 calibration all see the same
split. Images are decoded by ``capserve.data.images.load_image``, the service's own path for an upload, so a served
image is prepared exactly as its training images were (``capserve.data.cache`` keeps them decoded). Bad files are
skipped and counted; more than ``MAX_FAILED_FRACTION`` of them stops the run (``DataError``).
"""

from __future__ import annotations

import csv
import logging
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from capserve.data.builtin import has_builtin_files
from capserve.data.images import IMAGE_SUFFIXES, ImageError, InputSpec, load_image
from capserve.data.progress import progress_bar
from capserve.data.splits import Split, resolve_val_size
from capserve.errors import DataError

__all__ = [
    "MAX_FAILED_FRACTION",
    "MAX_PIXELS",
    "SPLITS",
    "FailureLog",
    "InputSize",
    "Manifest",
    "Sample",
    "carve",
    "check_data_exists",
    "check_labels",
    "check_training",
    "decode_all",
    "decode_split",
    "draw",
    "is_own_data",
    "iter_decoded",
    "scan",
    "scan_csv",
    "scan_folder",
    "split_labels",
    "targets_for",
    "with_validation",
]

log = logging.getLogger(__name__)


SPLITS = ("train", "val", "test")


REQUIRED_COLUMNS = ("image", "labels")


MAX_FAILED_FRACTION = 0.01  # more failing files than this stops the run


VAL_SEED = 0


SHOWN_FAILURES = 20  # paths listed in a stopping error


# A user's own photos may be larger than the service accepts by default (25 MP): only Pillow's own decompression-bomb
# limit applies. The limit only refuses images; an image it admits is preprocessed exactly as the service does.
MAX_PIXELS = Image.MAX_IMAGE_PIXELS or 89_478_485


@dataclass(frozen=True)
class Sample:
    """One image of the data: its file, its labels and where it was named (for messages)."""

    path: Path
    labels: tuple[str, ...]
    where: str  # "cats/1.png" or "train.csv line 7"


@dataclass
class Manifest:
    """The images and labels of a folder or CSV, by split; nothing decoded yet."""

    source: Path
    kind: Literal["folder", "csv"]
    splits: dict[str, list[Sample]]  # "train" always (maybe empty), "val" and "test" when the data has them
    named_splits: bool  # the data names its splits (a train/ folder, or a split column)

    @property
    def task(self) -> Literal["single_label", "multi_label"]:
        return "single_label" if self.kind == "folder" else "multi_label"

    @property
    def labels(self) -> tuple[str, ...]:
        """The training split's labels, sorted (every label of the data when it has no training images)."""
        samples = self.splits["train"] or [s for split in self.splits.values() for s in split]
        return tuple(sorted({label for s in samples for label in s.labels}))


@dataclass(frozen=True)
class InputSize:
    """The model input the images are decoded to (an ``InputSpec`` for ``capserve.data.images``)."""

    in_channels: int
    image_size: int
    mean: tuple[float, ...] = ()
    std: tuple[float, ...] = ()


# ------------------------------------------------------------------------------------------------ finding data


def is_own_data(path: str | Path) -> bool:
    """True for a CSV (or any other file: ``scan`` says what it should be) or a folder without built-in dataset
    files (CIFAR pickles, MNIST IDX, packs)."""
    path = Path(path)
    if path.suffix.lower() == ".csv" or path.is_file():
        return True
    return path.is_dir() and not has_builtin_files(path)


def scan(path: str | Path, label_separator: str | None = None) -> Manifest:
    """The manifest of an image folder or a CSV file (``DataError`` naming the fix when neither works); a CSV's
    labels are split on ``label_separator`` (None: on spaces)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"data {path} does not exist")
    if path.is_file():
        if path.suffix.lower() != ".csv":
            raise DataError(f"{path} is a file but not a .csv manifest; pass a CSV or a folder of label folders")
        return scan_csv(path, label_separator)
    if label_separator is not None:
        raise DataError(
            f"--label-separator is for a CSV's labels column; {path} is a folder, whose label folders' "
            "names are the labels (spaces included)"
        )
    return scan_folder(path)


def check_data_exists(data: str | Path) -> None:
    """A ``--data`` that names nothing: said as such (not as missing CIFAR files), before anything is written."""
    if not Path(data).exists():
        raise DataError(
            f"--data {data}: no such file or folder (working directory {Path.cwd()}); give a folder of "
            "label folders, a CSV, or the folder with the CIFAR/MNIST files"
        )


def split_labels(text: str, separator: str | None = None) -> tuple[str, ...]:
    """A CSV labels cell → its labels, unique, in order: split on spaces, or on ``separator`` (each stripped)."""
    parts = text.split() if separator is None else (p.strip() for p in text.split(separator))
    return tuple(dict.fromkeys(p for p in parts if p))


def _visible(path: Path, root: Path) -> bool:
    return not any(part.startswith(".") for part in path.relative_to(root).parts)


def _label_folders(directory: Path, root: Path) -> tuple[list[Sample], int]:
    """Images under ``directory/<label>/`` (any depth) and the number of other files ignored."""
    samples, ignored = [], 0
    for label_dir in sorted(p for p in directory.iterdir() if p.is_dir() and not p.name.startswith(".")):
        for file in sorted(p for p in label_dir.rglob("*") if p.is_file() and _visible(p, label_dir)):
            if file.suffix.lower() in IMAGE_SUFFIXES:
                samples.append(Sample(file, (label_dir.name,), str(file.relative_to(root))))
            else:
                ignored += 1
    return samples, ignored


def scan_folder(root: Path) -> Manifest:
    """``root/<label>/...`` or ``root/train/<label>/...`` (+ ``val/``, ``test/``)."""
    # a test/ (or val/) folder alone is named splits too: the usual thing to evaluate (training says what is missing)
    named = any((root / s).is_dir() for s in SPLITS)
    splits: dict[str, list[Sample]] = {"train": []}
    ignored = 0
    for split in SPLITS if named else ("train",):
        directory = root / split if named else root
        if directory.is_dir():
            splits[split], n = _label_folders(directory, root)
            ignored += n
    if ignored:
        log.info("%s: ignored %d files without an image suffix (%s)", root, ignored, " ".join(sorted(IMAGE_SUFFIXES)))
    if not any(splits.values()):
        loose = sum(1 for p in root.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
        hint = f" ({loose} images lie directly in {root}: move them into their label folders)" if loose else ""
        raise DataError(
            f"no images found in {root}{hint}: put them in one folder per label, {root}/<label>/<images> "
            f"(or {root}/train/<label>/..., with optional val/ and test/); image files are "
            f"{', '.join(sorted(IMAGE_SUFFIXES))}. For the built-in CIFAR/MNIST files see "
            "`python -c 'import capserve.data; help(capserve.data)'`"
        )
    return Manifest(root, "folder", splits, named)


def _csv_path(raw: str, root: Path, where: str) -> Path:
    """The file a CSV row names, refusing paths that leave the CSV's folder."""
    if not raw:
        raise DataError(f"{where}: the image column is empty; give a path relative to {root}")
    if os.path.isabs(raw) or raw.startswith(("/", "\\")) or (len(raw) > 1 and raw[1] == ":"):
        raise DataError(f"{where}: image path {raw!r} is absolute; give it relative to the CSV's folder {root}")
    normal = os.path.normpath(raw)
    if normal == ".." or normal.startswith(".." + os.sep):
        raise DataError(f"{where}: image path {raw!r} leaves the CSV's folder {root}; move the image under it")
    return root / normal


def scan_csv(path: Path, label_separator: str | None = None) -> Manifest:
    """A CSV manifest with columns image, labels (split on spaces, or on ``label_separator``) and optionally
    split."""
    if label_separator is not None and (not label_separator or label_separator in "\r\n"):
        raise DataError(f"--label-separator {label_separator!r}: give one or more characters, e.g. ';' or '|'")
    root = path.parent
    splits: dict[str, list[Sample]] = {"train": []}
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            reader = csv.DictReader(f)
            header = [h.strip() for h in reader.fieldnames or []]
            reader.fieldnames = header
            missing = [c for c in REQUIRED_COLUMNS if c not in header]
            if missing:
                raise DataError(
                    f"{path} lacks the column(s) {', '.join(missing)} (its header is {header}); the "
                    "first line must name the columns: image,labels[,split]"
                )
            named = "split" in header
            for row in reader:
                where = f"{path.name} line {reader.line_num}"
                split = (row.get("split") or "").strip().lower() or "train"
                if split not in SPLITS:
                    raise DataError(f"{where}: split {split!r} is not one of {', '.join(SPLITS)} (empty means train)")
                image = _csv_path((row.get("image") or "").strip(), root, where)
                labels = split_labels(row.get("labels") or "", label_separator)
                splits.setdefault(split, []).append(Sample(image, labels, where))
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text ({e}); save it as UTF-8 CSV") from e
    except csv.Error as e:
        raise DataError(f"{path} is not a readable CSV ({e})") from e
    if not any(splits.values()):
        raise DataError(f"{path} names no images: add one row per image (image,labels[,split])")
    return Manifest(path, "csv", splits, named)


def check_training(manifest: Manifest) -> tuple[str, ...]:
    """The labels to train on, after checking the manifest can train a classifier."""
    source = manifest.source
    if not manifest.splits["train"] and manifest.kind == "folder" and not (source / "train").is_dir():
        raise DataError(
            f"{source} has a val/ or test/ folder but no train/ folder: put the training images in "
            f"{source}/train/<label>/"
        )
    if not manifest.splits["train"]:
        raise DataError(
            f"{source} has no training images (rows with split train or an empty split)"
            if manifest.kind == "csv"
            else f"{source}/train holds no images in label folders"
        )
    labels = manifest.labels
    if len(labels) < 2:
        what = "label folder" if manifest.kind == "folder" else "label in its training rows"
        raise DataError(
            f"{source} has {len(labels)} {what} ({', '.join(map(repr, labels)) or 'none'}); a classifier "
            "needs at least two labels"
        )
    check_labels(manifest, labels, "the training labels")
    return labels


def check_labels(manifest: Manifest, labels: Sequence[str], what: str, splits: Sequence[str] = ("val", "test")) -> None:
    """Every label of ``splits`` must be one of ``labels``; the error names the first file with each stranger."""
    known = set(labels)
    strangers: dict[str, str] = {}
    for split in splits:
        for s in manifest.splits.get(split, []):
            for label in s.labels:
                if label not in known:
                    strangers.setdefault(label, f"{split}: {s.where}")
    if strangers:
        listed = "; ".join(f"{label!r} (first in {where})" for label, where in list(strangers.items())[:10])
        raise DataError(f"{manifest.source}: labels not among {what} ({', '.join(map(repr, labels))}): {listed}")


# ------------------------------------------------------------------------------------------------ validation


def carve(samples: Sequence[Sample], count: int, stratified: bool, seed: int = VAL_SEED) -> tuple[list[int], list[int]]:
    """Indices (train, val) with ``count`` validation samples, drawn by ``seed``.

    Stratified: each label gives about its share of ``count`` (within one), and never its last training sample.
    """
    n = len(samples)
    rng = np.random.default_rng(seed)
    u = rng.permutation(n)  # a random rank per sample
    if stratified:
        names = sorted({s.labels[0] for s in samples})
        cls = np.array([names.index(s.labels[0]) for s in samples])
        order = np.lexsort((u, cls))  # by label, then randomly
        sizes = np.bincount(cls, minlength=len(names))
        rank = np.empty(n, dtype=np.int64)
        rank[order] = np.arange(n) - np.repeat(np.cumsum(sizes) - sizes, sizes)  # rank within its label
        key = (rank + 0.5) / sizes[cls]
        key[rank == sizes[cls] - 1] = np.inf  # the last sample of each label stays in train
        if count > int(np.isfinite(key).sum()):
            raise DataError(
                f"--val-size {count} leaves some label without a training image; use at most "
                f"{int(np.isfinite(key).sum())}"
            )
        chosen = np.lexsort((u, key))[:count]
    else:
        chosen = u[:count]
    val = np.zeros(n, dtype=bool)
    val[chosen] = True
    return np.flatnonzero(~val).tolist(), np.flatnonzero(val).tolist()


def draw(
    samples: Sequence[Sample], count: int, stratify: bool = True, seed: int = VAL_SEED
) -> tuple[list[int], list[int], bool]:
    """``carve`` of ``count`` samples, stratified by label when ``stratify``, every sample has one label and each
    label can spare its share; else a plain seeded draw. Returns (the rest, the drawn, whether it was stratified)."""
    if stratify and all(len(s.labels) == 1 for s in samples):
        try:
            return *carve(samples, count, True, seed), True
        except DataError:  # a label with too few images to leave one behind
            pass
    return *carve(samples, count, False, seed), False


def with_validation(manifest: Manifest, val_size: int | float) -> tuple[Manifest, int]:
    """The manifest with a val split (carved from train when the data has none) and the carved count (0 if none)."""
    if manifest.splits.get("val"):
        return manifest, 0
    train = manifest.splits["train"]
    count = resolve_val_size(val_size, len(train))
    keep, val = carve(train, count, stratified=manifest.task == "single_label")
    splits = {**manifest.splits, "train": [train[i] for i in keep], "val": [train[i] for i in val]}
    return Manifest(manifest.source, manifest.kind, splits, manifest.named_splits), count


# ------------------------------------------------------------------------------------------------ decoding


def targets_for(samples: Sequence[Sample], labels: Sequence[str], multi_label: bool) -> Tensor:
    """(N,) int64 class indices, or (N, K) float32 multi-hot rows, in the order of ``labels``."""
    index = {label: i for i, label in enumerate(labels)}
    if multi_label:
        hot = torch.zeros(len(samples), len(labels), dtype=torch.float32)
        for row, s in enumerate(samples):
            hot[row, [index[label] for label in s.labels]] = 1.0
        return hot
    wrong = [s for s in samples if len(s.labels) != 1]
    if wrong:
        raise DataError(
            f"a single-label model needs exactly one label per image; {wrong[0].where} has "
            f"{len(wrong[0].labels)} ({len(wrong)} such rows)"
        )
    return torch.tensor([index[s.labels[0]] for s in samples], dtype=torch.int64)


def _decode(sample: Sample, spec: InputSpec) -> np.ndarray | str:
    """uint8 (C, H, W), or the reason the file failed."""
    try:
        return load_image(sample.path.read_bytes(), spec, max_pixels=MAX_PIXELS)
    except (ImageError, OSError) as e:
        return f"{type(e).__name__}: {e}"


class FailureLog:
    """Files that failed to decode; ``check`` stops with the list when more than ``MAX_FAILED_FRACTION`` failed."""

    def __init__(self, total: int, source: Path):
        self.total, self.source = total, source
        self.failures: list[tuple[str, str]] = []

    def add(self, sample: Sample, reason: str) -> None:
        self.failures.append((sample.where, reason))

    def check(self) -> None:
        """Raise ``DataError`` listing the failures if there are too many; else log the first few."""
        if len(self.failures) > MAX_FAILED_FRACTION * self.total:
            listed = "\n".join(f"  {where}: {reason}" for where, reason in self.failures[:SHOWN_FAILURES])
            more = len(self.failures) - SHOWN_FAILURES
            raise DataError(
                f"{len(self.failures)} of {self.total} images in {self.source} cannot be read (more than "
                f"{MAX_FAILED_FRACTION:.0%}); fix or remove them:\n{listed}"
                + (f"\n  ... and {more} more" if more > 0 else "")
            )
        if self.failures:
            first = "; ".join(f"{where} ({reason})" for where, reason in self.failures[:3])
            log.warning(
                "skipped %d of %d unreadable images in %s, first: %s",
                len(self.failures),
                self.total,
                self.source,
                first,
            )


def iter_decoded(
    samples: Sequence[Sample],
    spec: InputSpec,
    failures: FailureLog,
    batch_size: int = 256,
    desc: str = "decoding",
    workers: int | None = None,
) -> Iterator[tuple[np.ndarray, list[int]]]:
    """Batches of decoded images: uint8 (b, C, H, W) and the indices of ``samples`` they hold (failures skipped).

    Pillow releases the GIL while it decodes, so a thread per core decodes in parallel; only one batch of images
    is held at a time.
    """
    workers = workers or min(8, os.cpu_count() or 1)
    with ThreadPoolExecutor(workers) as pool, progress_bar(len(samples), desc) as bar:
        for start in range(0, len(samples), batch_size):
            chunk = samples[start : start + batch_size]
            arrays, kept = [], []
            for offset, result in enumerate(pool.map(lambda s: _decode(s, spec), chunk)):
                if isinstance(result, str):
                    failures.add(chunk[offset], result)
                else:
                    arrays.append(result)
                    kept.append(start + offset)
            bar.update(len(chunk))
            empty = np.zeros((0, spec.in_channels, spec.image_size, spec.image_size), np.uint8)
            yield (np.stack(arrays) if arrays else empty), kept


def decode_all(
    samples: Sequence[Sample], spec: InputSize, failures: FailureLog, desc: str
) -> tuple[np.ndarray, list[int]]:
    """Every readable image of ``samples`` as uint8 (N, C, H, W), and the indices of the samples they are."""
    parts, kept = [], []
    for images, index in iter_decoded(samples, spec, failures, desc=desc):
        parts.append(images)
        kept += index
    if not parts:
        return np.zeros((0, spec.in_channels, spec.image_size, spec.image_size), np.uint8), kept
    return np.concatenate(parts), kept


def decode_split(
    samples: Sequence[Sample],
    labels: Sequence[str],
    multi_label: bool,
    spec: InputSize,
    failures: FailureLog,
    desc: str,
) -> Split:
    """Every readable image of ``samples`` as a ``Split`` (images (N, C, H, W) uint8 and targets)."""
    images, kept = decode_all(samples, spec, failures, desc)
    return Split(torch.from_numpy(images), targets_for([samples[i] for i in kept], labels, multi_label))
