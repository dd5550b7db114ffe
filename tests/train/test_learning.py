"""A run on a user's images learns with the defaults, or says loudly that it did not (``capserve train``)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from support.data import write_marks
from support.models import tiny_overrides

import capserve
from capserve.cli import main
from capserve.evaluate import metrics as ev
from capserve.export.onnx import load_checkpoint
from capserve.model.checkpoint import not_learned_warning
from capserve.serving.settings import Settings
from capserve.serving.sources import open_model
from capserve.train.loop import has_learned, prior_score


def write_orientations(root: Path, per_label: int, rng: np.random.Generator, informative: bool = True) -> Path:
    """A kind of data no other test uses: a bar in random colours on random colours, horizontal, vertical or
    diagonal, anywhere in the picture. ``informative=False`` draws the bar at random, whatever the label."""
    labels = ("horizontal", "vertical", "diagonal")
    for li, label in enumerate(labels):
        (root / label).mkdir(parents=True)
        for i in range(per_label):
            kind = li if informative else int(rng.integers(3))
            bg, fg = rng.integers(0, 100, 3), rng.integers(156, 256, 3)
            pixels = np.broadcast_to(bg, (24, 24, 3)).copy()
            y, x = rng.integers(2, 10, 2)
            for t in range(12):
                r, c = ((y + 5, x + t), (y + t, x + 5), (y + t, x + t))[kind]
                pixels[r : r + 2, c : c + 2] = fg
            Image.fromarray(pixels.astype(np.uint8)).save(root / label / f"{i}.png")
    return root


def test_a_new_kind_of_data_learns_with_the_defaults_alone(tmp_path, capsys):
    """Only --data, --out and --epochs: the default model and recipe learn well above the label prior."""
    data = write_orientations(tmp_path / "bars", 40, np.random.default_rng(0))
    out = tmp_path / "run"
    assert main(["train", "--data", str(data), "--out", str(out), "--epochs", "12"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    recorded = json.loads((out / "train_config.json").read_text())
    assert recorded["model"] == "cifar10-conv" and recorded["optimizer"] == "adamw"
    assert summary["learned"] is True and summary["best_val_acc"] >= summary["prior_val_acc"] + 0.4
    assert not_learned_warning(out / "best") is None


def tiny_args(model: str = "cifar10-simple") -> list[str]:
    return [
        f"--set={key}={json.dumps(value if not isinstance(value, tuple) else [vars(v) for v in value])}"
        for key, value in tiny_overrides(model).items()
    ]


def test_a_run_that_learns_nothing_says_so_exits_non_zero_and_marks_best(tmp_path, capsys, caplog):
    data = write_orientations(tmp_path / "noise", 24, np.random.default_rng(1), informative=False)
    out = tmp_path / "run"
    with caplog.at_level(logging.INFO):
        code = main(
            [
                "train",
                "--data",
                str(data),
                "--out",
                str(out),
                "--epochs",
                "2",
                "--val-size",
                "24",
                "--image-size",
                "16",
                *tiny_args(),
            ]
        )
    assert code == 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["learned"] is False
    assert "the run did not learn" in caplog.text and "always answering" in caplog.text
    training = json.loads((out / "best" / "config.json").read_text())["training"]
    assert training["learned"] is False and training["prior_val"] == summary["prior_val_acc"]
    warning = not_learned_warning(out / "best")
    assert warning is not None and "did not learn" in warning
    for opens in (
        lambda: load_checkpoint(out / "best"),  # what `capserve export onnx` opens
        lambda: open_model(str(out / "best"), Settings(backend="torch", multilabel_model="none")),
    ):  # serve
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            opens()
        assert "did not learn" in caplog.text


def test_the_prior_is_the_most_common_answer_and_learning_must_clear_its_noise():
    train = torch.tensor([0, 0, 0, 1, 2])
    assert prior_score(train, torch.tensor([0, 1, 1, 0])) == (0.5, "0")
    sets = torch.tensor([[1.0, 0, 1], [1, 0, 1], [0, 1, 0]])
    assert prior_score(sets, torch.tensor([[1.0, 0, 1], [0, 0, 1]])) == (0.5, "0,2")
    # 100 images at a prior of 0.5: two standard errors (0.1) and one image (0.01) above it
    assert not has_learned(0.61, 0.5, 100) and has_learned(0.62, 0.5, 100)
    assert not has_learned(0.1, 0.1, 1000) and has_learned(1.0, 0.0, 10) and not has_learned(0.1, 0.0, 10)


def test_calibration_keeps_half_for_a_class_without_signal():
    """A threshold that answers a label for every image beats F1 on a class the model knows nothing of; it must not
    be chosen (a memorising model's thresholds came out at 0.05 and the server then answered almost everything)."""
    g = torch.Generator().manual_seed(0)
    truth = torch.rand(400, 2, generator=g) < 0.7  # (N, 2): frequent labels
    logits = torch.randn(400, 2, generator=g) * 0.1 - 2.0  # no signal, every probability low
    logits[:, 1] += 4.0 * truth[:, 1]  # class 1 is separable
    thresholds = ev.fit_thresholds(logits, truth.float())
    assert thresholds[0] == 0.5 and 0.05 < thresholds[1] < 0.95


def test_multi_label_summary_figure_is_the_one_evaluate_gives(tmp_path, capsys):
    """summary.json's test figure and `capserve evaluate` on best/ use the same thresholds and decision rule."""
    rng = np.random.default_rng(2)
    (tmp_path / "img").mkdir()
    rows = ["image,labels,split"]
    for i in range(120):
        present = [name for name in ("red", "blue") if rng.random() < 0.5] or ["red"]
        pixels = rng.integers(0, 60, (16, 16, 3)).astype(np.uint8)
        if "red" in present:
            pixels[:8, :, 0] = 250
        if "blue" in present:
            pixels[8:, :, 2] = 250
        Image.fromarray(pixels).save(tmp_path / "img" / f"{i}.png")
        rows.append(f"img/{i}.png,{' '.join(present)},{'test' if i >= 100 else 'train'}")
    (tmp_path / "labels.csv").write_text("\n".join(rows) + "\n")
    out = tmp_path / "run"
    code = main(
        [
            "train",
            "--model",
            "cifar10-simple",
            "--data",
            str(tmp_path / "labels.csv"),
            "--out",
            str(out),
            "--epochs",
            "8",
            "--image-size",
            "16",
            *tiny_args(),
        ]
    )
    summary = json.loads((out / "summary.json").read_text())
    assert code == 0 and summary["learned"] is True
    capsys.readouterr()
    assert main(["evaluate", str(out / "best"), "--data", str(tmp_path / "labels.csv"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    T = capserve.read_config(out / "best").iterations
    assert report["thresholds"] == summary["thresholds"]
    assert report["results"][str(T)]["exact_match"] == pytest.approx(summary["test_acc"], abs=1e-9)


def test_shared_class_weights_vote_alike_wherever_a_part_lies():
    """class_weights='shared': the class layer's parents do not depend on where its children lie on the grid;
    with a transform per position they do."""
    torch.manual_seed(0)
    for mode, invariant in (("shared", True), ("per_position", False)):
        model = capserve.create_model("cifar10-simple", **tiny_overrides("cifar10-simple"), class_weights=mode)
        layer = model.capsules[-1]
        children = torch.randn(2, 5, 5, 4, 16)  # (B, H, W, I, D)
        moved = children.roll(shifts=(2, 1), dims=(1, 2))
        same = all(
            torch.allclose(a, b, atol=1e-5)
            for a, b in zip(layer.route(children, 3)[0], layer.route(moved, 3)[0], strict=True)
        )
        assert same is invariant, mode
    shared = capserve.create_model("cifar10-simple", class_weights="shared")
    per_position = capserve.create_model("cifar10-simple")
    assert shared.capsules[-1].weight.shape[0] * 25 == per_position.capsules[-1].weight.shape[0]
    with pytest.raises(ValueError, match="class_weights must be"):
        capserve.create_model("cifar10-simple", class_weights="pooled")


def test_with_activations_a_silent_child_changes_nothing():
    """activations=True: a child whose gate is closed (background, clutter) adds nothing to its parents, whatever
    its pose; without the gate every LayerNorm'd pose votes in full, so the same change moves the parents."""
    torch.manual_seed(0)
    children = torch.randn(2, 5, 5, 4, 16)  # (B, H, W, I, D)
    children[:, :2, :, :, 0] = -40.0  # the top two rows: first pose value far below zero
    other = children.clone()
    other[:, :2, :, :, 1:] = torch.randn(2, 2, 5, 4, 15)  # the same silent children with other poses
    for activations, unchanged in ((True, True), (False, False)):
        model = capserve.create_model(
            "cifar10-simple", **tiny_overrides("cifar10-simple"), class_weights="shared", activations=activations
        )
        layer = model.capsules[-1]
        if activations:
            with torch.no_grad():  # the gate reads the first pose value: closed where it is far below zero
                layer.activation.weight.zero_()
                layer.activation.weight[0, 0] = 1.0
                layer.activation.bias.zero_()
        same = torch.allclose(layer.route(children, 3)[0], layer.route(other, 3)[0], atol=1e-5)
        assert same is unchanged, activations


def test_objects_anywhere_get_shared_class_transforms_and_learn_with_the_defaults(tmp_path, caplog):
    """A small mark anywhere on noise: the run measures that its labels do not follow position, takes one class
    transform per capsule type (recorded, so that --resume rebuilds the same model), says why, and learns. (With a
    transform per position the same run stays at the prior: docs/own-data.md.)"""
    data = write_marks(tmp_path / "marks", 100, np.random.default_rng(0), placed=True)
    out = tmp_path / "run"
    with caplog.at_level(logging.INFO, logger="capserve"):
        assert main(["train", "--data", str(data), "--out", str(out), "--epochs", "8"]) == 0
    recorded = json.loads((out / "train_config.json").read_text())
    assert recorded["overrides"] == {"class_weights": "shared"}
    assert capserve.load(out / "best").config.class_weights == "shared"
    assert "class capsule transforms: shared (the labels do not follow where things lie" in caplog.text
    summary = json.loads((out / "summary.json").read_text())
    assert summary["learned"] is True and summary["best_val_acc"] >= summary["prior_val_acc"] + 0.3, summary


def test_a_given_class_weights_is_kept_and_the_default_model_gates_its_children(tmp_path, caplog):
    data = write_marks(tmp_path / "marks", 4, np.random.default_rng(0), placed=True)
    out = tmp_path / "run"
    args = ["train", "--data", str(data), "--out", str(out), "--epochs", "1", "--no-test", "--val-size", "0"]
    with caplog.at_level(logging.INFO, logger="capserve"):
        main([*args, "--set", 'class_weights="per_position"'])
    assert json.loads((out / "train_config.json").read_text())["overrides"] == {"class_weights": "per_position"}
    assert "class capsule transforms" not in caplog.text
    assert capserve.get_config("cifar10-conv").activations
