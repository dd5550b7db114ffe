"""Tiny CIFAR/MNIST files in the official formats, and a training config that runs in seconds."""

from __future__ import annotations

import gzip
import pickle
import struct
from pathlib import Path

import numpy as np
from PIL import Image
from torch import Tensor

from capserve.data.cache import build_cache
from capserve.data.own import InputSize, scan
from capserve.train.config import TrainConfig
from support.models import tiny_overrides


def write_cifar10(root, n_per_batch: int = 4, seed: int = 0):
    d = root / "cifar-10-batches-py"
    d.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    for name in [*(f"data_batch_{i}" for i in range(1, 6)), "test_batch"]:
        labels = rng.integers(0, 10, n_per_batch).tolist()
        images = rng.integers(0, 256, (n_per_batch, 3072), dtype=np.uint8)
        with open(d / name, "wb") as f:
            pickle.dump({"batch_label": name, "labels": labels, "data": images, "filenames": []}, f, protocol=2)
    with open(d / "batches.meta", "wb") as f:
        pickle.dump({"label_names": ["a"] * 10}, f)
    return d


def write_cifar100(root, n: int = 6):
    d = root / "cifar-100-python"
    d.mkdir(parents=True)
    rng = np.random.default_rng(1)
    for name in ("train", "test"):
        payload = {
            "fine_labels": rng.integers(0, 100, n).tolist(),
            "coarse_labels": [0] * n,
            "data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
        }
        with open(d / name, "wb") as f:
            pickle.dump(payload, f)
    with open(d / "meta", "wb") as f:
        pickle.dump({"fine_label_names": ["x"] * 100}, f)
    return d


def idx_bytes(array: np.ndarray) -> bytes:
    return bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes()


def write_mnist(d, n_train: int = 60, n_test: int = 20, compress: bool = True, seed: int = 0):
    """Digits whose pixels are random; labels cycle through all 10 classes."""
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        labels = (np.arange(n) % 10).astype(np.uint8)
        for kind, arr in (("images-idx3", images), ("labels-idx1", labels)):
            raw = idx_bytes(arr)
            name = d / f"{prefix}-{kind}-ubyte"
            if compress:
                (d / (name.name + ".gz")).write_bytes(gzip.compress(raw))
            else:
                name.write_bytes(raw)
    return d


def write_easy_cifar10(root: Path, n_per_batch: int = 12, n_test: int = 20) -> Path:
    """CIFAR-10 files whose classes differ by colour, so that a few steps can learn them."""
    import pickle

    d = root / "cifar-10-batches-py"
    d.mkdir(parents=True)
    rng = np.random.default_rng(0)
    palette = rng.integers(0, 256, (10, 3))
    for name, n in [*((f"data_batch_{i}", n_per_batch) for i in range(1, 6)), ("test_batch", n_test)]:
        labels = rng.integers(0, 10, n)
        images = palette[labels][:, :, None] + rng.integers(-20, 21, (n, 3, 1024))
        payload = {"labels": labels.tolist(), "data": images.clip(0, 255).astype(np.uint8).reshape(n, 3072)}
        with open(d / name, "wb") as f:
            pickle.dump(payload, f)
    return d


def cfg(model: str, data: Path, out: Path, **kw) -> TrainConfig:
    # fp32 unless a test asks otherwise: --amp auto would train in bf16 on a CPU with native bf16, and these runs'
    # figures must not depend on the CPU that runs them (tests/train/test_amp.py tests the choice on stand-ins)
    base = dict(
        overrides=tiny_overrides(model),
        epochs=2,
        batch_size=16,
        lr=0.05,
        val_size=12,
        eval_batch_size=32,
        device="cpu",
        amp="off",
    )
    return TrainConfig(model=model, data=str(data), out=str(out), **{**base, **kw})


MARKS = ("square", "plus", "cross")  # three 6×6 marks a small canvas can hold anywhere


def mark_pixels(kind: str) -> np.ndarray:
    """A 6×6 boolean mask: a hollow square, a plus or an X."""
    mask = np.zeros((6, 6), bool)
    if kind == "square":
        mask[[0, -1], :] = mask[:, [0, -1]] = True
    elif kind == "plus":
        mask[2:4, :] = mask[:, 2:4] = True
    else:
        mask[np.arange(6), np.arange(6)] = mask[np.arange(6), 5 - np.arange(6)] = True
    return mask


def write_marks(
    root: Path, per_label: int, rng: np.random.Generator, placed: bool, side: int = 24, plain: bool = False
) -> Path:
    """A folder of label folders (``MARKS``): one mark on grey noise (``plain``: on one grey), anywhere on the canvas
    (``placed``), or each label's mark always at the same place, the centre."""
    for kind in MARKS:
        (root / kind).mkdir(parents=True)
        mask = mark_pixels(kind)
        for i in range(per_label):
            pixels = (
                np.full((side, side), 40, np.uint8) if plain else rng.integers(0, 90, (side, side)).astype(np.uint8)
            )
            y, x = rng.integers(0, side - 5, 2) if placed else ((side - 6) // 2,) * 2
            pixels[y : y + 6, x : x + 6][mask] = 255
            Image.fromarray(pixels).save(root / kind / f"{i}.png")
    return root


def write_strokes(root: Path, per_label: int, rng: np.random.Generator, side: int = 24) -> Path:
    """A folder of two label folders a mirror swaps: a rising diagonal stroke (``rising``, /) or a falling one
    (``falling``, \\), a third of the side long, near the centre of grey noise."""
    for label in ("rising", "falling"):
        (root / label).mkdir(parents=True)
        for i in range(per_label):
            pixels = rng.integers(0, 90, (side, side)).astype(np.uint8)
            y, x = rng.integers(side // 3, side // 3 + 4, 2)
            steps = np.arange(side // 3)
            columns = x + (steps if label == "falling" else steps[::-1])
            pixels[y + steps, columns] = 255
            Image.fromarray(pixels).save(root / label / f"{i}.png")
    return root


def decoded_training(root: Path) -> tuple[Tensor, Tensor]:
    """The training images (N, 3, 32, 32) uint8 and targets of the folder ``root``, decoded as a run decodes them."""
    manifest = scan(root)
    train = build_cache(manifest, manifest.labels, InputSize(3, 32), None).splits["train"]
    return train.images, train.targets
