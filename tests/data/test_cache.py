"""The decoded-image cache of a user's data (``capserve.data.cache``): exactly the service's decoding, reused while
the files, labels and input size stay, decoded again when any changes; unreadable files counted or stopping."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from support.own import LABELS, SIZE, picture, write_csv, write_folder

from capserve.data.cache import CACHE_FILE, build_cache
from capserve.data.images import load_image
from capserve.data.own import InputSize, scan
from capserve.errors import DataError


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """train/ (34 per label and one truncated file: under 1 % fail) and test/ (4 per label)."""
    root = write_folder(tmp_path_factory.mktemp("own") / "photos", train=34, test=4)
    (root / "train" / LABELS[1] / "broken.png").write_bytes(picture(LABELS[1], 0)[:60])  # truncated PNG
    return root


def test_cache_holds_exactly_what_the_service_decodes(folder, tmp_path):
    manifest = scan(folder)
    spec = InputSize(3, SIZE)
    cache = tmp_path / "cache.safetensors"
    built = build_cache(manifest, LABELS, spec, cache)
    assert not built.from_cache and built.skipped == 1  # the truncated PNG
    train = built.splits["train"]
    readable = [s for s in manifest.splits["train"] if s.path.name != "broken.png"]
    assert len(train) == len(readable) == 102
    for row, sample in enumerate(readable):  # every mode and format: pixel for pixel the service's preprocessing
        assert torch.equal(train.images[row], torch.from_numpy(load_image(sample.path.read_bytes(), spec)))
        assert LABELS[int(train.targets[row])] == sample.labels[0]
    again = build_cache(manifest, LABELS, spec, cache)
    assert again.from_cache and torch.equal(again.splits["train"].images, train.images) and again.skipped == 1
    changed = readable[3].path
    changed.write_bytes(picture(LABELS[0], 99))  # new content → decoded again
    os.utime(changed, ns=(1, 1))
    rebuilt = build_cache(manifest, LABELS, spec, cache)
    assert not rebuilt.from_cache
    assert not build_cache(manifest, LABELS, InputSize(3, 24), cache).from_cache  # another size


def test_more_than_one_percent_unreadable_stops_with_the_list(tmp_path, capsys):
    root = write_folder(tmp_path / "bad", train=4)
    (root / LABELS[0] / "a.png").write_bytes(b"not an image")
    (root / LABELS[2] / "b.jpg").write_bytes(b"\xff\xd8\xff truncated")
    with pytest.raises(DataError, match=r"2 of 14 images .* cannot be read") as e:
        build_cache(scan(root), LABELS, InputSize(3, SIZE), None)
    assert "red fox/b.jpg" in str(e.value) and "blue whale/a.png" in str(e.value)


def test_relabelled_csv_rebuilds_the_cache(tmp_path):
    root = tmp_path / "c"
    (root / "img").mkdir(parents=True)
    for i in range(4):
        (root / "img" / f"{i}.png").write_bytes(picture(LABELS[i % 3], i))
    first = write_csv(root, [(f"img/{i}.png", "a" if i < 2 else "b", "train") for i in range(4)])
    cache = tmp_path / CACHE_FILE
    spec = InputSize(3, SIZE)
    old = build_cache(scan(first), ("a", "b"), spec, cache)
    # the same files and the same label set, but two images swap their labels
    again = write_csv(root, [(f"img/{i}.png", "b" if i in (0, 3) else "a", "train") for i in range(4)])
    new = build_cache(scan(again), ("a", "b"), spec, cache)
    assert not new.from_cache
    assert new.splits["train"].targets.tolist() == [[0, 1], [1, 0], [1, 0], [0, 1]]
    assert not torch.equal(new.splits["train"].targets, old.splits["train"].targets)
    assert build_cache(scan(again), ("a", "b"), spec, cache).from_cache  # unchanged again: reused
