"""Unreadable files in a user's own data at the documented boundary (docs/training.md: more than 1 % failing stops the
run): exactly 1 % is skipped and training goes on; one file more stops it with the list. Counted over every split."""

from __future__ import annotations

import dataclasses
import io
import logging
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from support.models import tiny_overrides

from capserve.data.cache import build_cache
from capserve.data.own import InputSize, scan
from capserve.errors import DataError
from capserve.train.config import TrainConfig
from capserve.train.loop import train

LABELS = ("dark", "light")
SIZE = 16


def png(label: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    pixels = np.clip(40 + 170 * label + rng.integers(-20, 21, (SIZE, SIZE, 3)), 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


def write(root: Path, images: int, unreadable: int, splits: dict[str, float] | None = None) -> Path:
    """``images`` files in ``root/<split>/<label>/`` (or ``root/<label>/``), the first ``unreadable`` of them broken,
    spread over the splits by ``splits`` (split → share)."""
    shares = splits or {"": 1.0}
    names = [split for split, share in shares.items() for _ in range(round(share * images))]
    assert len(names) == images
    for i, split in enumerate(names):
        folder = root / split / LABELS[i % 2] if split else root / LABELS[i % 2]
        folder.mkdir(parents=True, exist_ok=True)
        data = b"\x89PNG\r\n\x1a\n truncated" if i < unreadable else png(i % 2, i)
        (folder / f"{i:04d}.png").write_bytes(data)
    return root


def decode(root: Path):
    return build_cache(scan(root), LABELS, InputSize(3, SIZE), None)


@pytest.mark.parametrize(("images", "unreadable"), [(100, 0), (100, 1), (200, 1), (200, 2), (300, 3)])
def test_up_to_exactly_one_percent_unreadable_is_skipped(tmp_path, caplog, images, unreadable):
    with caplog.at_level(logging.WARNING, logger="capserve.data.own"):
        data = decode(write(tmp_path / "data", images, unreadable))
    assert data.skipped == unreadable and len(data.splits["train"]) == images - unreadable
    if unreadable:
        assert f"skipped {unreadable} of {images} unreadable images" in caplog.text


@pytest.mark.parametrize(("images", "unreadable"), [(100, 2), (200, 3), (300, 4), (99, 1)])
def test_one_unreadable_file_over_one_percent_stops_with_the_list(tmp_path, images, unreadable):
    with pytest.raises(DataError, match=rf"{unreadable} of {images} images .* cannot be read \(more than 1%\)") as e:
        decode(write(tmp_path / "data", images, unreadable))
    assert "0000.png" in str(e.value) and f"{unreadable - 1:04d}.png" in str(e.value)


def test_the_boundary_counts_every_split(tmp_path):
    """80 train, 10 val, 10 test: one broken file (in train) is 1 % of the 100 the run decodes, two are over it."""
    splits = {"train": 0.8, "val": 0.1, "test": 0.1}
    assert decode(write(tmp_path / "one", 100, 1, splits)).skipped == 1
    with pytest.raises(DataError, match="2 of 100 images"):
        decode(write(tmp_path / "two", 100, 2, splits))


def test_training_with_exactly_one_percent_unreadable_runs_and_reports_them(tmp_path):
    root = write(tmp_path / "data", 100, 1)
    config = TrainConfig(
        model="cifar10-simple",
        data=str(root),
        out=str(tmp_path / "run"),
        overrides=tiny_overrides("cifar10-simple"),
        epochs=1,
        batch_size=16,
        lr=0.05,
        eval_batch_size=32,
        device="cpu",
        image_size=SIZE,
        val_size=10,
    )
    summary = train(config)
    assert summary["skipped_images"] == 1
    (root / LABELS[1] / "0001.png").write_bytes(b"not an image either")  # a second one: 2 % of the files
    with pytest.raises(DataError, match="2 of 100 images"):
        train(dataclasses.replace(config, out=str(tmp_path / "run2")))
