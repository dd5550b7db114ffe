"""TODO docstring."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
import torch
from support.data import write_cifar10, write_cifar100, write_mnist

from capserve.data.augment import random_crop_flip
from capserve.data.builtin import (
    load_cifar10,
    load_cifar100,
    load_mnist,
    load_test,
    load_training,
    load_validation,
    pack_cifar,
)
from capserve.data.multimnist import multimnist
from capserve.data.splits import Split

# ------------------------------------------------------------------------------------------------ loaders


def test_cifar10_layouts(tmp_path):
    d = write_cifar10(tmp_path)
    for root in (tmp_path, d):  # the parent folder or the batch folder itself
        train, test = load_cifar10(root, train=True), load_cifar10(root, train=False)
        assert train.images.shape == (20, 3, 32, 32) and train.images.dtype == torch.uint8
        assert test.images.shape == (4, 3, 32, 32) and train.targets.dtype == torch.int64
    with open(d / "data_batch_2", "rb") as f:
        raw = pickle.load(f)
    # row-major CHW layout: the first 1024 values are the red plane
    assert torch.equal(train.images[4, 0].flatten(), torch.from_numpy(raw["data"][0, :1024]))
    assert train.targets[4:8].tolist() == raw["labels"]


def test_cifar100_fine_labels(tmp_path):
    d = write_cifar100(tmp_path)
    train = load_cifar100(tmp_path, train=True)
    with open(d / "train", "rb") as f:
        assert train.targets.tolist() == pickle.load(f)["fine_labels"]
    assert load_cifar100(d, train=False).images.shape == (6, 3, 32, 32)


@pytest.mark.parametrize("compress", [True, False])
@pytest.mark.parametrize("layout", ["MNIST/raw", ""])
def test_mnist_gz_and_raw(tmp_path, compress, layout):
    write_mnist(tmp_path / layout if layout else tmp_path, compress=compress)
    digits, labels = load_mnist(tmp_path, train=True)
    assert digits.shape == (60, 28, 28) and digits.dtype == torch.uint8
    assert labels.tolist() == [i % 10 for i in range(60)]
    assert load_mnist(tmp_path, train=False)[0].shape == (20, 28, 28)


def test_missing_files_say_where_to_get_them(tmp_path):
    with pytest.raises(FileNotFoundError, match="cs.toronto.edu"):
        load_cifar10(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_cifar100(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="MNIST"):
        load_mnist(tmp_path)
    d = write_cifar10(tmp_path / "c")
    os.remove(d / "data_batch_3")
    with pytest.raises(FileNotFoundError, match="data_batch_3"):
        load_cifar10(d)


def test_malformed_cifar(tmp_path):
    d = write_cifar10(tmp_path)
    (d / "data_batch_1").write_bytes((d / "data_batch_1").read_bytes()[:100])  # truncated
    with pytest.raises(ValueError, match="not a CIFAR python batch"):
        load_cifar10(d)
    with open(d / "data_batch_1", "wb") as f:
        pickle.dump({"labels": [1], "data": np.zeros((1, 100), np.uint8)}, f)  # wrong shape
    with pytest.raises(ValueError, match="3072"):
        load_cifar10(d)
    (d / "data_batch_1").write_bytes(b"cos\nsystem\n(S'echo hacked'\ntR.")  # code in a pickle is refused
    with pytest.raises(ValueError, match=r"refusing to load (os|posix)\.system"):
        load_cifar10(d)


def test_malformed_mnist(tmp_path):
    d = write_mnist(tmp_path, compress=False)
    good = (d / "train-images-idx3-ubyte").read_bytes()
    (d / "train-images-idx3-ubyte").write_bytes(good[:-10])
    with pytest.raises(ValueError, match="truncated"):
        load_mnist(d)
    (d / "train-images-idx3-ubyte").write_bytes(b"\x12\x34" + good[2:])
    with pytest.raises(ValueError, match="magic"):
        load_mnist(d)
    (d / "train-images-idx3-ubyte").write_bytes(good)
    (d / "train-labels-idx1-ubyte").unlink()
    with pytest.raises(FileNotFoundError, match="train-labels"):
        load_mnist(d)
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / "train-images-idx3-ubyte.gz").write_bytes(b"not gzip at all")
    with pytest.raises(ValueError, match="cannot be read"):
        load_mnist(tmp_path / "g")


def test_jpeg_pack_round_trip(tmp_path):
    g = torch.Generator().manual_seed(0)
    smooth = torch.nn.functional.interpolate(torch.rand(150, 3, 8, 8, generator=g), size=32, mode="bilinear")
    split = Split((smooth * 255).to(torch.uint8), torch.arange(150) % 10)
    pack_cifar(split, tmp_path / "pack", columns=20, quality=95, subsampling="4:4:4")
    back = load_cifar10(tmp_path / "pack")  # a pack stands in for the batch folder
    assert back.images.shape == split.images.shape and torch.equal(back.targets, split.targets)
    assert (back.images.float() - split.images.float()).abs().mean() < 3
    with pytest.raises(FileNotFoundError, match="holds splits"):
        load_cifar10(tmp_path / "pack", train=False)


# ------------------------------------------------------------------------------------------------ augmentation


def test_random_crop_flip_is_a_crop_of_the_padded_image():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (64, 3, 8, 8), dtype=torch.uint8, generator=g)
    y = random_crop_flip(x, padding=2, generator=torch.Generator().manual_seed(1))
    assert y.shape == x.shape and y.dtype == torch.uint8
    padded = torch.nn.functional.pad(x, (2, 2, 2, 2))
    seen = set()
    for i in range(len(x)):
        crops = {
            (dy, dx, f): padded[i, :, dy : dy + 8, dx : dx + 8]
            for dy in range(5)
            for dx in range(5)
            for f in (False, True)
        }
        matches = [k for k, c in crops.items() if torch.equal(y[i], c.flip(-1) if k[2] else c)]
        assert matches, f"image {i} is not a (flipped) crop"
        seen.update(matches)
    assert {m[2] for m in seen} == {False, True} and len({m[:2] for m in seen}) > 10


# ------------------------------------------------------------------------------------------------ DiverseMultiMNIST


def _blocks(n_per_class: int = 5):
    """Full 28×28 blocks of 255 (so each placed digit's square shows its exact shift), labels 0..9."""
    labels = torch.arange(10).repeat_interleave(n_per_class)
    return torch.full((len(labels), 28, 28), 255, dtype=torch.uint8), labels


def test_multimnist_statistics():
    digits, labels = _blocks()
    s = multimnist(digits, labels, 6000, torch.Generator().manual_seed(0))
    assert s.images.shape == (6000, 3, 36, 36) and s.images.dtype == torch.uint8
    assert torch.equal(s.images[:, 0], s.images[:, 2])  # replicated channels
    counts = s.targets.sum(1)
    assert set(counts.unique().tolist()) <= {1.0, 2.0}  # two digits are always of different classes
    assert abs((counts == 1).float().mean().item() - 1 / 6) < 0.02
    assert s.images.max() == 255  # overlapping 255 + 255 is clipped, not wrapped
    # single-digit images: the square's corner is the shift, within ±4 of the centre offset 4
    single = s.images[counts == 1, 0] > 0  # (n, 36, 36)
    rows, cols = single.any(2).float().argmax(1) - 4, single.any(1).float().argmax(1) - 4
    assert rows.min() == -4 and rows.max() == 4 and cols.min() == -4 and cols.max() == 4
    assert (single.sum((1, 2)) == 28 * 28).all()  # never cut by the canvas edge


def test_multimnist_targets_match_digits_and_is_deterministic():
    g = torch.Generator().manual_seed(0)
    digits = torch.randint(0, 256, (50, 28, 28), dtype=torch.uint8, generator=g)
    labels = torch.arange(50) % 10
    a = multimnist(digits, labels, 300, torch.Generator().manual_seed(5))
    b = multimnist(digits, labels, 300, torch.Generator().manual_seed(5))
    c = multimnist(digits, labels, 300, torch.Generator().manual_seed(6))
    assert torch.equal(a.images, b.images) and torch.equal(a.targets, b.targets)
    assert not torch.equal(a.images, c.images)
    # a single digit: the image is that digit shifted, so its pixel sum equals one of the class's digits
    single = a.targets.sum(1) == 1
    for img, t in zip(a.images[single][:20, 0], a.targets[single][:20], strict=True):
        cls = int(t.argmax())
        sums = digits[labels == cls].flatten(1).long().sum(1)
        assert int(img.long().sum()) in sums.tolist()


def test_multimnist_needs_all_classes():
    digits, labels = _blocks()
    with pytest.raises(ValueError, match="all 10 classes"):
        multimnist(digits[labels < 9], labels[labels < 9], 10, torch.Generator().manual_seed(0))


def test_training_splits(tmp_path):
    write_mnist(tmp_path, n_train=200, n_test=40)
    d = load_training("multimnist", tmp_path, val_size=50, epoch_size=64)
    assert len(d.val) == 50 and len(d.digits[0]) == 150
    assert d.epoch(0, 0, torch.device("cpu")).images.shape[0] == 64
    e0, e0b, e1 = (d.epoch(e, 0, torch.device("cpu")) for e in (0, 0, 1))
    assert torch.equal(e0.images, e0b.images) and not torch.equal(e0.images, e1.images)
    assert torch.equal(load_test("multimnist", tmp_path).images, load_test("multimnist", tmp_path).images)
    assert torch.equal(load_validation("multimnist", tmp_path, 50).images, d.val.images)
    write_cifar10(tmp_path / "c", n_per_batch=10)
    c = load_training("cifar10", tmp_path / "c", val_size=10)
    assert len(c.train) == 40 and len(c.val) == 10
    with pytest.raises(ValueError, match="val-size"):
        load_training("cifar10", tmp_path / "c", val_size=50)


def test_a_warning_during_a_progress_bar_prints_on_its_own_line():
    """`capserve evaluate` logs warnings (such as routing's fused kernel failing to build) while its bar is drawn:
    the warning must start a line of its own, not trail the bar's text."""
    import re
    import subprocess
    import sys

    script = """
import logging
from capserve.data.progress import progress_bar
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")  # as the CLI does
with progress_bar(10, "scoring") as bar:
    bar.update(5)
    logging.getLogger("capserve.routing").warning("a warning during the bar")
    bar.update(5)
"""
    err = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stderr
    assert "scoring" in err and "10/10" in err  # the bar was drawn, and finished
    assert re.search(r"(^|[\r\n])WARNING a warning during the bar\n", err), repr(err)
