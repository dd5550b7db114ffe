"""``--augment`` policies and their defaults per data kind, mean/std from a user's images, ``--freeze backbone``."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from support.models import tiny_overrides

import capserve
from capserve.cli import main
from capserve.data.augment import AUGMENTATIONS, apply_augment, default_augment
from capserve.data.cache import CACHE_FILE
from capserve.data.preprocess import data_mean_std
from capserve.model.checkpoint import save_model
from capserve.train.config import DEFAULT_WEIGHT_DECAY, TrainConfig, resolve_recipe
from capserve.train.few_images import FEW_IMAGES_A_CLASS
from capserve.train.loop import augment, train

SIZE = 16


def write_digits(root: Path, per_label: int = 12, colour: bool = False) -> Path:
    """``root/<label>/`` of grey strokes on black (RGB files with three equal channels, like scanned digits), or of
    coloured noise pictures when ``colour``."""
    rng = np.random.default_rng(0)
    for li, label in enumerate(("bar", "dot")):
        (root / label).mkdir(parents=True)
        for i in range(per_label):
            if colour:
                pixels = rng.integers(0, 256, (SIZE, SIZE, 3)).astype(np.uint8)
                pixels[..., li] = 255
            else:
                grey = rng.integers(0, 20, (SIZE, SIZE)).astype(np.uint8)
                if li:
                    grey[4:12, 6:10] = 200
                else:
                    grey[7:9, 2:14] = 220
                pixels = np.stack([grey] * 3, -1)
            Image.fromarray(pixels).save(root / label / f"{i}.png")
    return root


def config(data: Path, out: Path, **kw) -> TrainConfig:
    base = dict(
        overrides=tiny_overrides("cifar10-simple"),
        epochs=1,
        batch_size=8,
        lr=0.05,
        eval_batch_size=16,
        device="cpu",
        image_size=SIZE,
        val_size=4,
        test=False,
    )
    return TrainConfig(model="cifar10-simple", data=str(data), out=str(out), **{**base, **kw})


def pattern(batch: int = 64) -> torch.Tensor:
    """(B, 1, 16, 16) uint8 images whose every pixel differs, so that a crop or a mirror is recognisable."""
    return (torch.arange(16 * 16) % 251 + 1).to(torch.uint8).view(1, 1, 16, 16).repeat(batch, 1, 1, 1)


def offsets(out: torch.Tensor, image: torch.Tensor) -> list[tuple[int, int, bool]]:
    """For each augmented image, the (dy, dx, mirrored) that produced it from ``image`` (zero-padded by 2)."""
    padded = torch.nn.functional.pad(image, (2, 2, 2, 2))
    found = []
    for o in out:
        crops = {(dy, dx): padded[..., dy : dy + 16, dx : dx + 16] for dy in range(5) for dx in range(5)}
        hits = [
            (dy, dx, m)
            for m in (False, True)
            for (dy, dx), c in crops.items()
            if torch.equal(o, c.flip(-1) if m else c)
        ]
        assert hits, "an augmented image is neither a shift nor a mirrored shift of its input"
        found.append(hits[0])
    return found


def test_policies_shift_and_mirror_as_named():
    images = pattern()
    g = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    assert torch.equal(apply_augment("none", images, g()), images)
    shifted = offsets(apply_augment("shift", images, g()), images[0])
    flipped = offsets(apply_augment("crop-flip", images, g()), images[0])
    assert not any(m for _, _, m in shifted)  # a shift never mirrors (a mirrored digit is another digit)
    assert len({(dy, dx) for dy, dx, _ in shifted}) > 5  # per-image offsets of up to 16 // 8 = 2 pixels
    assert 16 < sum(m for _, _, m in flipped) < 48  # about half mirrored
    assert [s[:2] for s in shifted] == [f[:2] for f in flipped]  # same generator: same crops, with or without flip
    with pytest.raises(ValueError, match="unknown augmentation 'rotate'"):
        apply_augment("rotate", images)


def test_default_policy_per_data_kind():
    """CIFAR keeps the authors' crop-flip; a user's images, colour or grey, train without augmentation by default
    (a shift or a mirror held short capsule runs at the prior on the own-data battery's letters and photos)."""
    assert default_augment("cifar10") == default_augment("cifar100") == "crop-flip"
    assert default_augment("multimnist") == "none"  # its shifts are built into the generated images
    assert default_augment("csv") == default_augment("folder") == "none"


def test_training_batches_follow_the_policy():
    images = pattern(8).repeat(1, 3, 1, 1)
    c = SimpleNamespace(mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0), image_size=16)

    def run(policy):
        return SimpleNamespace(
            cfg=SimpleNamespace(augment=policy, seed=0, channels_last=False),
            model=SimpleNamespace(config=c),
            device=torch.device("cpu"),
        )

    assert torch.equal(augment(run("none"), images, 0, 0), images.float() / 255)
    assert not torch.equal(augment(run("shift"), images, 0, 0), images.float() / 255)


@pytest.mark.parametrize(
    "colour, flag, expected", [(False, None, "none"), (True, None, "none"), (False, "shift", "shift")]
)
def test_own_data_records_the_policy_and_its_own_mean_std(tmp_path, colour, flag, expected):
    data = write_digits(tmp_path / "digits", 2 * FEW_IMAGES_A_CLASS, colour)  # few a class may take crop-flip
    out = tmp_path / "run"
    summary = train(config(data, out, augment=flag))
    recorded = json.loads((out / "train_config.json").read_text())
    assert recorded["augment"] == expected and summary["augment"] == expected
    # a user's images: AdamW with its decoupled decay, one-cycle, batch 32 unless given (this test gives 8)
    assert (recorded["optimizer"], recorded["weight_decay"], recorded["schedule"]) == ("adamw", 5e-2, "onecycle")
    best = capserve.read_config(out / "best")
    assert json.loads((out / "best" / "config.json").read_text())["training"]["recipe"]["augment"] == expected
    # mean/std are the training images' (the carved validation images excluded), so serving uses the same
    train_images = load_file(str(out / CACHE_FILE))["train.images"]
    stats = data_mean_std(train_images)
    assert best.mean == stats["mean"] and best.std == stats["std"]
    x = train_images.double() / 255
    assert best.mean[0] == pytest.approx(x[:, 0].mean().item(), abs=1e-4)
    assert best.std[1] == pytest.approx(x[:, 1].std(unbiased=False).item(), abs=1e-4)
    assert best.mean != capserve.get_config("cifar10-simple").mean


def test_mean_std_of_a_constant_channel_never_divides_by_zero():
    stats = data_mean_std(torch.zeros(3, 2, 4, 4, dtype=torch.uint8), chunk=2)
    assert stats == {"mean": (0.0, 0.0), "std": (round(1 / 255, 4),) * 2}


def test_init_keeps_its_mean_std_and_freeze_backbone_keeps_its_weights(tmp_path, capsys):
    data = write_digits(tmp_path / "digits")
    source = tmp_path / "source"
    # a ResNet backbone: BatchNorm statistics that training mode would move
    model = capserve.create_model(
        "cifar10-simple",
        **tiny_overrides("cifar10-simple"),
        backbone="resnet",
        image_size=SIZE,
        mean=(0.25, 0.5, 0.75),
        std=(0.1, 0.2, 0.3),
        labels=("bar", "dot"),
    )
    save_model(model, source)
    out = tmp_path / "ft"
    code = main(
        [
            "train",
            "--init",
            str(source),
            "--data",
            str(data),
            "--out",
            str(out),
            "--epochs",
            "1",
            "--batch-size",
            "8",
            "--val-size",
            "4",
            "--no-test",
            "--freeze",
            "backbone",
        ]
    )
    assert code == 0  # too few validation images to judge learning: a warning, no verdict; no usage error (2)
    tuned = capserve.load(out / "last")
    assert tuned.config.mean == (0.25, 0.5, 0.75) and tuned.config.std == (0.1, 0.2, 0.3)
    before, after = model.state_dict(), tuned.state_dict()
    frozen = [k for k in before if k.startswith("backbone.")]
    assert any(k.endswith("running_mean") for k in frozen) and all(
        torch.equal(before[k], after[k]) for k in frozen
    )  # BatchNorm statistics included
    assert not torch.equal(before["primary.conv.weight"], after["primary.conv.weight"])  # the capsules trained
    recorded = json.loads((out / "train_config.json").read_text())
    assert recorded["freeze"] == "backbone" and recorded["optimizer"] == "adamw"  # own data, --init or not
    capsys.readouterr()
    assert (
        main(
            [
                "train",
                "--model",
                "cifar10-simple",
                "--data",
                str(data),
                "--out",
                str(tmp_path / "x"),
                "--freeze",
                "backbone",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "--freeze backbone keeps a trained backbone: give --init" in err and "Traceback" not in err


def test_bad_augment_is_refused(tmp_path, capsys):
    with pytest.raises(ValueError, match="--augment must be one of"):
        config(tmp_path, tmp_path / "r", augment="flip")
    assert set(AUGMENTATIONS) == {"none", "shift", "crop-flip"}
    with pytest.raises(SystemExit):
        main(
            [
                "train",
                "--model",
                "cifar10-simple",
                "--data",
                str(tmp_path),
                "--out",
                str(tmp_path / "r"),
                "--augment",
                "rotate",
            ]
        )
    assert "invalid choice: 'rotate'" in capsys.readouterr().err


def test_auto_recipe_by_data_and_given_values_reach_the_optimizer(tmp_path, capsys):
    """The "auto" optimizer keeps the authors' SGD recipe for the built-in data sets and trains a user's images with
    AdamW (its decoupled decay; none on biases and norms), one-cycle and batch 32; every value given wins."""
    base = TrainConfig(model="cifar10-simple", data="d", out="o")
    builtin, own = resolve_recipe(base, own_data=False), resolve_recipe(base, own_data=True)
    assert (
        builtin.optimizer,
        builtin.lr,
        builtin.momentum,
        builtin.weight_decay,
        builtin.schedule,
        builtin.batch_size,
    ) == ("sgd", 0.1, 0.9, 5e-4, "step", 128)
    assert (own.optimizer, own.lr, own.momentum, own.weight_decay, own.schedule, own.batch_size) == (
        "adamw",
        2e-3,
        None,
        DEFAULT_WEIGHT_DECAY["adamw"],
        "onecycle",
        32,
    )
    given = resolve_recipe(
        TrainConfig(
            model="cifar10-simple",
            data="d",
            out="o",
            optimizer="sgd",
            lr=0.01,
            weight_decay=0.0,
            schedule="cosine",
            batch_size=32,
        ),
        own_data=True,
    )
    assert (given.optimizer, given.lr, given.momentum, given.weight_decay, given.schedule, given.batch_size) == (
        "sgd",
        0.01,
        0.9,
        0.0,
        "cosine",
        32,
    )
    with pytest.raises(ValueError, match="--momentum is SGD's"):
        resolve_recipe(TrainConfig(model="cifar10-simple", data="d", out="o", momentum=0.5), own_data=True)
    data = write_digits(tmp_path / "digits")
    out = tmp_path / "run"
    train(config(data, out, weight_decay=0.0))
    assert json.loads((out / "train_config.json").read_text())["weight_decay"] == 0.0
    groups = json.loads((out / "last" / "trainer.json").read_text())["param_groups"]
    assert [g["weight_decay"] for g in groups] == [0.0] * len(groups)  # what the optimizer ran with
    out2 = tmp_path / "run2"
    train(config(data, out2))
    matrices, vectors = json.loads((out2 / "last" / "trainer.json").read_text())["param_groups"]
    assert (matrices["weight_decay"], vectors["weight_decay"]) == (DEFAULT_WEIGHT_DECAY["adamw"], 0.0)
    with pytest.raises(ValueError, match="--weight-decay must be >= 0"):
        config(data, out, weight_decay=-1e-4)
