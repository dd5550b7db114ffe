"""Datasets as uint8 tensors in memory: CIFAR-10/100, MNIST, DiverseMultiMNIST, and on-device augmentation.

Every split is a ``Split``: images (N, C, H, W) uint8 and targets, (N,) int64 class indices or (N, K) float32
multi-hot rows. Batches are sliced from these tensors and augmented as whole tensors on the training device
(no DataLoader, no per-image Python), so the same code runs at GPU speed; ``capserve.data.preprocess.normalize`` then
turns them into the network's input with the config's mean/std.

Files (nothing is downloaded; get them from the official pages):
    CIFAR-10   ``cifar-10-batches-py/`` (data_batch_1..5, test_batch, batches.meta) from
               https://www.cs.toronto.edu/~kriz/cifar.html ("CIFAR-10 python version").
    CIFAR-100  ``cifar-100-python/`` (train, test, meta), same page; fine labels (100 classes) are used.
    MNIST      train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte,
               each raw or ``.gz``, from http://yann.lecun.com/exdb/mnist/ or any mirror (torchvision's
               ``MNIST/raw/`` folder works as is).
``--data DIR`` may be the folder holding the files, or any parent in the usual layouts (``DIR/cifar-10-batches-py``,
``DIR/cifar10/cifar-10-batches-py``, ``DIR/MNIST/raw``, ``DIR/mnist/MNIST/raw``). A CIFAR folder may instead hold a
compact *pack* (``capserve-pack.json`` + JPEG mosaics, see ``pack_cifar``), used to ship a training set to a
remote GPU machine.

A folder of your own images or a CSV manifest is read by ``capserve.data.own`` instead.

DiverseMultiMNIST (Tsai et al. 2020, after Sabour et al. 2017's MultiMNIST). Choices the paper leaves open, ours:
    - canvas 36×36; each 28×28 digit is placed at the centre offset (4, 4) and shifted independently by an integer
      (dy, dx) drawn uniformly from [-4, 4] each, so a digit never leaves the canvas;
    - with probability 1/6 an image holds one digit, otherwise two digits of different classes (the second class
      uniform over the 9 others, then a uniform digit of that class); pixels add, clipped at 255;
    - the single channel is replicated to 3 channels (the models take RGB-like input), MNIST mean/std;
    - targets: 10-way multi-hot (one or two ones);
    - training images are generated on the fly, a new set of ``epoch_size`` (default 60,000) images per epoch,
      seeded by (seed, epoch), from the MNIST training digits minus a held-out validation pool;
    - validation: ``val_size`` (default 5,000) training digits are held out (a fixed permutation, seed 0) and a fixed
      set of ``val_size`` images is generated from them (seed 1);
    - test: a fixed set of 10,000 images generated from the 10,000 MNIST test digits (seed 2).
"""

from __future__ import annotations

import gzip
import json
import logging
import pickle
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
from torch import Tensor

from capserve.data.augment import epoch_generator
from capserve.data.multimnist import CANVAS, multimnist
from capserve.data.splits import Split, resolve_val_size

log = logging.getLogger(__name__)


DATASETS = ("cifar10", "cifar100", "multimnist")


PACK_FILE = "capserve-pack.json"


MULTIMNIST_TEST_SIZE = 10_000


_VAL_SEED, _VAL_GEN_SEED, _TEST_GEN_SEED = 0, 1, 2


CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar.html (CIFAR-10 python version, cifar-10-python.tar.gz)"


CIFAR100_URL = "https://www.cs.toronto.edu/~kriz/cifar.html (CIFAR-100 python version, cifar-100-python.tar.gz)"


MNIST_URL = "http://yann.lecun.com/exdb/mnist/ (or a mirror; torchvision's MNIST/raw folder works as is)"


# ---------------------------------------------------------------------------------------------------------- files


def _find_dir(root: str | Path, candidates: Sequence[str], marker: Sequence[str], what: str, url: str) -> Path:
    """The first of ``root/candidate`` that holds any of the ``marker`` files."""
    root = Path(root)
    if not root.exists():
        raise FileNotFoundError(f"data folder {root} does not exist; {what} files come from {url}")
    for sub in candidates:
        d = root / sub
        if any((d / m).is_file() for m in marker):
            return d
    looked = ", ".join(str(root / c) for c in candidates)
    raise FileNotFoundError(f"no {what} files found (looked in {looked} for {marker[0]}); get them from {url}")


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickles the CIFAR batches (dicts, lists, numpy arrays) and refuses anything else: no code runs."""

    ALLOWED: ClassVar[set[tuple[str, str]]] = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),
    }

    def find_class(self, module: str, name: str):  # type: ignore[no-untyped-def]
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a data file")


def _read_pickle(path: Path, url: str) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; get the files from {url}")
    try:
        with open(path, "rb") as f:
            data = _ArrayUnpickler(f, encoding="latin1").load()
    except Exception as e:  # truncated or foreign files raise many different errors
        raise ValueError(
            f"{path} is not a CIFAR python batch ({type(e).__name__}: {e}); re-extract it from {url}"
        ) from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a CIFAR python batch (got {type(data).__name__}); re-extract it from {url}")
    return data


def _cifar_batch(path: Path, label_key: str, url: str) -> tuple[np.ndarray, np.ndarray]:
    data = _read_pickle(path, url)
    if "data" not in data or label_key not in data:
        raise ValueError(f"{path} lacks the 'data' or '{label_key}' entry of a CIFAR batch; re-extract it from {url}")
    images = np.asarray(data["data"])
    labels = np.asarray(data[label_key], dtype=np.int64)
    if images.dtype != np.uint8 or images.ndim != 2 or images.shape[1] != 3 * 32 * 32 or len(images) != len(labels):
        raise ValueError(
            f"{path}: expected uint8 data (N, 3072) with N labels, got {images.dtype} {images.shape} "
            f"and {len(labels)} labels; re-extract it from {url}"
        )
    return images.reshape(-1, 3, 32, 32), labels


# dataset → (sub-folders searched, files that mark the dataset's folder)
_LAYOUTS = {
    "cifar10": (["", "cifar-10-batches-py", "cifar10/cifar-10-batches-py"], ["data_batch_1", "test_batch", PACK_FILE]),
    "cifar100": (["", "cifar-100-python", "cifar100/cifar-100-python"], ["train", "test", PACK_FILE]),
    "mnist": (
        ["", "raw", "MNIST/raw", "mnist/MNIST/raw"],
        [f"{p}-images-idx3-ubyte{ext}" for p in ("train", "t10k") for ext in ("", ".gz")],
    ),
}


def has_builtin_files(root: str | Path) -> bool:
    """Whether ``root`` (or a usual sub-folder) holds CIFAR-10/100 or MNIST files, as opposed to a user's images."""
    root = Path(root)
    return any((root / sub / m).is_file() for subs, markers in _LAYOUTS.values() for sub in subs for m in markers)


def load_cifar10(root: str | Path, train: bool = True) -> Split:
    """CIFAR-10 train (50,000) or test (10,000) images (N, 3, 32, 32) uint8 and labels (N,)."""
    d = _find_dir(root, *_LAYOUTS["cifar10"], "CIFAR-10", CIFAR10_URL)
    if (d / PACK_FILE).is_file():
        return load_pack(d, "train" if train else "test")
    names = [f"data_batch_{i}" for i in range(1, 6)] if train else ["test_batch"]
    parts = [_cifar_batch(d / n, "labels", CIFAR10_URL) for n in names]
    return _split(parts, 10, d)


def load_cifar100(root: str | Path, train: bool = True) -> Split:
    """CIFAR-100 (fine labels) train (50,000) or test (10,000) images (N, 3, 32, 32) uint8 and labels (N,)."""
    d = _find_dir(root, *_LAYOUTS["cifar100"], "CIFAR-100", CIFAR100_URL)
    if (d / PACK_FILE).is_file():
        return load_pack(d, "train" if train else "test")
    return _split([_cifar_batch(d / ("train" if train else "test"), "fine_labels", CIFAR100_URL)], 100, d)


def _split(parts: list[tuple[np.ndarray, np.ndarray]], classes: int, where: Path) -> Split:
    images = torch.from_numpy(np.concatenate([p[0] for p in parts]))
    labels = torch.from_numpy(np.concatenate([p[1] for p in parts]))
    if len(labels) and (labels.min() < 0 or labels.max() >= classes):
        raise ValueError(f"labels in {where} fall outside 0..{classes - 1}: is this the right dataset?")
    return Split(images, labels)


_IDX_DTYPES = {0x08: np.uint8}


def read_idx(path: str | Path) -> np.ndarray:
    """An IDX file (raw or .gz) as a numpy array: (N, H, W) for images, (N,) for labels."""
    path = Path(path)
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise ValueError(f"{path} cannot be read ({e}); re-download it from {MNIST_URL}") from e
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES or not 1 <= raw[3] <= 3:
        raise ValueError(
            f"{path} is not an MNIST IDX file of uint8 (bad magic number); re-download it from {MNIST_URL}"
        )
    ndim = raw[3]
    if len(raw) < 4 + 4 * ndim:
        raise ValueError(f"{path} is truncated (header); re-download it from {MNIST_URL}")
    shape = struct.unpack(f">{ndim}I", raw[4 : 4 + 4 * ndim])
    body = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if body.size != int(np.prod(shape)):
        raise ValueError(
            f"{path} holds {body.size} values, its header says {shape}: truncated? re-download it from {MNIST_URL}"
        )
    return body.reshape(shape)


def load_mnist(root: str | Path, train: bool = True) -> tuple[Tensor, Tensor]:
    """MNIST digits (N, 28, 28) uint8 and labels (N,) int64 from IDX files (raw or .gz)."""
    prefix = "train" if train else "t10k"
    names = [f"{prefix}-images-idx3-ubyte", f"{prefix}-labels-idx1-ubyte"]
    marker = [n + ext for n in names[:1] for ext in (".gz", "")]
    d = _find_dir(root, ["", "raw", "MNIST/raw", "mnist/MNIST/raw"], marker, f"MNIST {prefix}", MNIST_URL)
    arrays = []
    for n in names:
        path = d / (n + ".gz") if (d / (n + ".gz")).is_file() else d / n
        if not path.is_file():
            raise FileNotFoundError(f"{d / n}[.gz] not found next to {marker[0]}; get it from {MNIST_URL}")
        arrays.append(read_idx(path))
    images, labels = arrays
    if images.ndim != 3 or images.shape[1:] != (28, 28) or labels.ndim != 1 or len(images) != len(labels):
        raise ValueError(
            f"MNIST files in {d}: expected images (N, 28, 28) and N labels, got {images.shape} and {labels.shape}"
        )
    if labels.size and labels.max() > 9:
        raise ValueError(f"MNIST labels in {d} exceed 9: is {names[1]} a label file?")
    return torch.from_numpy(images.copy()), torch.from_numpy(labels.astype(np.int64))


# ------------------------------------------------------------------------------------------------- JPEG packs


def pack_cifar(
    split: Split,
    directory: str | Path,
    name: str = "train",
    dataset: str = "cifar10",
    quality: int = 85,
    subsampling: str = "4:2:0",
    columns: int = 100,
) -> dict:
    """Write a split as JPEG mosaics of 32×32 tiles (+ labels) into ``directory``; return the pack entry.

    Tiles are aligned to JPEG's 16×16 blocks, so no image shares a block with another; one header per mosaic
    instead of one per image makes the pack about half the size of per-image files.
    """
    from PIL import Image

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    N, C, H, W = split.images.shape
    rows_per_file = 50
    per_file = rows_per_file * columns
    files = []
    for f, start in enumerate(range(0, N, per_file)):
        chunk = split.images[start : start + per_file]
        n = len(chunk)
        rows = -(-n // columns)
        grid = torch.zeros(rows * columns, C, H, W, dtype=torch.uint8)
        grid[:n] = chunk
        mosaic = grid.view(rows, columns, C, H, W).permute(0, 3, 1, 4, 2).reshape(rows * H, columns * W, C)
        file = f"{name}-{f:03d}.jpg"
        Image.fromarray(mosaic.numpy()).save(directory / file, quality=quality, subsampling=subsampling)
        files.append(file)
    entry = {"files": files, "count": N, "columns": columns, "tile": H, "labels": split.targets.tolist()}
    meta_path = directory / PACK_FILE
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {"dataset": dataset, "splits": {}}
    meta["splits"][name] = entry
    meta_path.write_text(json.dumps(meta))
    return entry


def load_pack(directory: str | Path, name: str) -> Split:
    """A split written by ``pack_cifar``."""
    from PIL import Image

    directory = Path(directory)
    meta = json.loads((directory / PACK_FILE).read_text())
    if name not in meta.get("splits", {}):
        raise FileNotFoundError(
            f"the pack in {directory} holds splits {sorted(meta.get('splits', {}))}, not "
            f"{name!r}; point --data at the original files for that split"
        )
    entry = meta["splits"][name]
    t, cols = entry["tile"], entry["columns"]
    parts = []
    for file in entry["files"]:
        with Image.open(directory / file) as im:
            a = torch.from_numpy(np.array(im.convert("RGB")))  # (rows·t, cols·t, 3)
        rows = a.shape[0] // t
        parts.append(a.view(rows, t, cols, t, 3).permute(0, 2, 4, 1, 3).reshape(rows * cols, 3, t, t))  # (n, 3, t, t)
    images = torch.cat(parts)[: entry["count"]].contiguous()
    return Split(images, torch.tensor(entry["labels"], dtype=torch.int64))


# --------------------------------------------------------------------------------------------------- datasets


@dataclass
class Data:
    """What training needs: a source of training batches, a validation split (maybe empty) and a test loader."""

    dataset: str
    train: Split | None  # fixed training images (CIFAR); None for generated data
    digits: tuple[Tensor, Tensor] | None  # MNIST training digits + labels for DiverseMultiMNIST
    val: Split | None
    epoch_size: int  # images per epoch

    def epoch(self, epoch: int, seed: int, device: torch.device) -> Split:
        """This epoch's training images in a seeded random order (generated for DiverseMultiMNIST), on ``device``."""
        g = epoch_generator(seed, epoch, device)
        if self.train is not None:
            perm = torch.randperm(len(self.train), device=device, generator=g)
            return Split(self.train.images[perm], self.train.targets[perm])
        assert self.digits is not None
        return multimnist(self.digits[0], self.digits[1], self.epoch_size, g)


def dataset_for(config_labels: Sequence[str], task: str, image_size: int) -> str:
    """The dataset a model config trains on (by its labels and task)."""
    from capserve.configs import CIFAR10_LABELS, CIFAR100_LABELS, DIGIT_LABELS

    if task == "multi_label" and tuple(config_labels) == DIGIT_LABELS and image_size == CANVAS:
        return "multimnist"
    if tuple(config_labels) == CIFAR10_LABELS and image_size == 32:
        return "cifar10"
    if tuple(config_labels) == CIFAR100_LABELS and image_size == 32:
        return "cifar100"
    raise ValueError(
        f"no built-in dataset matches this model (labels {list(config_labels)[:4]}..., task {task}, "
        f"image size {image_size}); built-in datasets: {', '.join(DATASETS)}"
    )


def _held_out(n: int, val_size: int | float) -> tuple[Tensor, Tensor]:
    val_size = resolve_val_size(val_size, n)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(_VAL_SEED))
    return perm[: n - val_size].sort().values, perm[n - val_size :].sort().values


def load_training(
    dataset: str,
    root: str | Path,
    val_size: int | float = 5000,
    epoch_size: int | None = None,
    device: str | torch.device = "cpu",
) -> Data:
    """Training data for ``dataset`` with a validation split carved from the training set by a fixed seed."""
    device = torch.device(device)
    if dataset in ("cifar10", "cifar100"):
        full = (load_cifar10 if dataset == "cifar10" else load_cifar100)(root, train=True)
        keep, val = _held_out(len(full), val_size)
        train, valid = full.subset(keep).to(device), full.subset(val).to(device) if len(val) else None
        return Data(dataset, train, None, valid, len(train))
    if dataset == "multimnist":
        digits, labels = load_mnist(root, train=True)
        keep, val = _held_out(len(digits), val_size)
        valid = None
        if len(val):
            g = torch.Generator().manual_seed(_VAL_GEN_SEED)
            valid = multimnist(digits[val], labels[val], len(val), g).to(device)
        pool = (digits[keep].to(device), labels[keep].to(device))
        return Data(dataset, None, pool, valid, epoch_size or len(digits))
    raise ValueError(f"unknown dataset {dataset!r}; choose one of {', '.join(DATASETS)}")


def load_test(dataset: str, root: str | Path) -> Split:
    """The test split (for DiverseMultiMNIST the fixed, seeded 10,000 images from the MNIST test digits)."""
    if dataset == "cifar10":
        return load_cifar10(root, train=False)
    if dataset == "cifar100":
        return load_cifar100(root, train=False)
    if dataset == "multimnist":
        digits, labels = load_mnist(root, train=False)
        return multimnist(digits, labels, MULTIMNIST_TEST_SIZE, torch.Generator().manual_seed(_TEST_GEN_SEED))
    raise ValueError(f"unknown dataset {dataset!r}; choose one of {', '.join(DATASETS)}")


def load_validation(dataset: str, root: str | Path, val_size: int | float) -> Split:
    """The validation split ``load_training`` carves with the same ``val_size`` (for calibration and evaluation)."""
    data = load_training(dataset, root, val_size=val_size)
    if data.val is None:
        raise ValueError("this checkpoint was trained without a validation split (--val-size 0)")
    return data.val
