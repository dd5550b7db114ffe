"""A run on a user's images learns with the defaults, or says loudly that it did not (``capserve train``)."""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from support.data import write_marks
from support.models import tiny_model, tiny_overrides

import capserve
import capserve.train.cli
from capserve.cli import main
from capserve.data.splits import Split
from capserve.evaluate import metrics as ev
from capserve.export.onnx import load_checkpoint
from capserve.model.checkpoint import not_learned_warning, save_model
from capserve.pipeline.models import open_model
from capserve.serving.settings import Settings
from capserve.train.verdict import (
    LEARNED_SHARE,
    chance_level,
    check_learned,
    has_learned,
    images_to_tell,
    mark_not_learned,
    prior_score,
    verdict,
)

ROOT = Path(__file__).resolve().parents[2]


BARS = ("horizontal", "vertical", "diagonal")


def draw_bar(pixels: np.ndarray, bar: str, rng: np.random.Generator) -> None:
    """A 12-pixel bar of ``BARS``, 2 pixels thick, in a bright random colour, anywhere in a 24×24 picture."""
    (y, x), colour = rng.integers(2, 10, 2), rng.integers(156, 256, 3)
    for t in range(12):
        r, c = {"horizontal": (y + 5, x + t), "vertical": (y + t, x + 5), "diagonal": (y + t, x + t)}[bar]
        pixels[r : r + 2, c : c + 2] = colour


def write_orientations(root: Path, per_label: int, rng: np.random.Generator) -> Path:
    """A kind of data no other test uses: a bar in random colours on random colours, horizontal, vertical or
    diagonal, anywhere in the picture."""
    for label in BARS:
        (root / label).mkdir(parents=True)
        for i in range(per_label):
            pixels = np.broadcast_to(rng.integers(0, 100, 3), (24, 24, 3)).copy()
            draw_bar(pixels, label, rng)
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


def write_bars_csv(root: Path, images: int, rng: np.random.Generator) -> Path:
    """Multi-label data of a kind no other test uses: a CSV naming which of three bars (horizontal, vertical,
    diagonal; at least one) cross a picture of random colours, each bar anywhere."""
    (root / "images").mkdir(parents=True)
    rows = ["image,labels"]
    for i in range(images):
        shown = [bar for bar in BARS if rng.random() < 0.5] or [BARS[int(rng.integers(3))]]
        pixels = np.broadcast_to(rng.integers(0, 100, 3), (24, 24, 3)).copy()
        for bar in shown:
            draw_bar(pixels, bar, rng)
        Image.fromarray(pixels.astype(np.uint8)).save(root / "images" / f"{i}.png")
        rows.append(f"images/{i}.png,{' '.join(shown)}")
    (root / "labels.csv").write_text("\n".join(rows) + "\n")
    return root / "labels.csv"


def test_a_multi_label_csv_learns_with_the_defaults_alone(tmp_path):
    """Only --data, --out and --epochs on a CSV: the default model and recipe learn each label on its own, well
    above the label-set prior, and the thresholds come from the validation split."""
    data = write_bars_csv(tmp_path / "bars", 160, np.random.default_rng(0))
    out = tmp_path / "run"
    assert main(["train", "--data", str(data), "--out", str(out), "--epochs", "12"]) == 0
    recorded = json.loads((out / "train_config.json").read_text())
    assert recorded["model"] == "cifar10-conv" and recorded["overrides"]["class_norm"] == "per_class"
    config = capserve.load(out / "best").config
    assert config.task == "multi_label" and config.thresholds is not None
    summary = json.loads((out / "summary.json").read_text())
    assert summary["learned"] is True and summary["best_val_acc"] >= summary["prior_val_acc"] + 0.3, summary


def tiny_args(model: str = "cifar10-simple") -> list[str]:
    return [
        f"--set={key}={json.dumps(value if not isinstance(value, tuple) else [vars(v) for v in value])}"
        for key, value in tiny_overrides(model).items()
    ]


def write_one_picture(root: Path, train: int, val: int) -> Path:
    """The same picture under every label, in ``train/`` and a balanced ``val/``: nothing to learn, and whatever a
    model answers for it scores exactly the label prior (one third) on validation, on any machine."""
    pixels = np.random.default_rng(3).integers(0, 256, (24, 24, 3), dtype=np.uint8)
    for split, count in (("train", train), ("val", val)):
        for label in ("horizontal", "vertical", "diagonal"):
            (root / split / label).mkdir(parents=True)
            for i in range(count):
                Image.fromarray(pixels).save(root / split / label / f"{i}.png")
    return root


def test_a_run_that_learns_nothing_says_so_exits_non_zero_and_marks_best(tmp_path, capsys, caplog):
    """...and the checkpoint it ends with is whole: ``--resume`` of the finished run says there is nothing left to
    train, sums the run up again and gives the same verdict and exit status."""
    data = write_one_picture(tmp_path / "one", train=12, val=8)
    out = tmp_path / "run"
    with caplog.at_level(logging.INFO):
        code = main(
            ["train", "--data", str(data), "--out", str(out), "--epochs", "2", "--image-size", "16", *tiny_args()]
        )
    assert code == 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["learned"] is False
    assert "the run did not learn" in caplog.text and "is no better than always answering" in caplog.text
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
    assert json.loads((out / "last" / "trainer.json").read_text())["state"]["epoch"] == 2
    assert capserve.load(out / "last") is not None and not [p for p in out.iterdir() if p.name.startswith(".")]
    metrics = (out / "metrics.jsonl").read_text()
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert main(["train", "--resume", str(out), "--epochs", "6", "--lr", "0.5", "--device", "cpu"]) == 1
    assert f"ignoring --epochs, --lr (to train on with other settings, start a new run with --init {out}/best)" in (
        caplog.text
    )
    assert "augmentation: none (as the run resumed recorded it)" in caplog.text
    assert f"{out} already trained its 2 epochs: --resume has nothing left to train" in caplog.text
    assert "the run did not learn" in caplog.text and "resumed from" not in caplog.text
    assert (out / "metrics.jsonl").read_text() == metrics  # nothing trained
    assert json.loads((out / "summary.json").read_text())["learned"] is False
    assert "did not learn" in not_learned_warning(out / "best")


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


def test_class_grid_shares_each_transform_within_a_cell_and_spans_shared_to_per_position():
    """class_grid=N: the class layer keeps one transform per child type in each cell of an N×N grid over its
    children, so a part votes alike anywhere in its cell and differently in another; 1 is class_weights='shared', the
    grid's side one transform per position, number for number."""
    torch.manual_seed(0)
    overrides = {**tiny_overrides("cifar10-simple"), "activations": False}
    per_position = capserve.create_model("cifar10-simple", **overrides)
    layer = per_position.capsules[-1]
    side, types = per_position.config.spatial_sizes[-1], overrides["capsules"][-1].types
    cells = capserve.create_model("cifar10-simple", **overrides, class_grid=2).capsules[-1]
    assert cells.weight.shape[0] == 4 * types and layer.weight.shape[0] == side * side * types
    votes = cells.votes_weight().unflatten(0, (side, side, types))  # (H, W, I, J, X, Y)
    rows = [0] * (side - side // 2) + [1] * (side // 2)  # the larger half first
    for h in range(side):
        for w in range(side):
            cell = cells.weight.unflatten(0, (2, 2, types))[rows[h], rows[w]]
            assert torch.equal(votes[h, w], cell)
    children = torch.randn(2, side, side, types, 16)  # (B, H, W, I, D)
    for grid, same_as in ((1, "shared"), (side, "per_position")):
        model = capserve.create_model("cifar10-simple", **overrides, class_grid=grid)
        reference = capserve.create_model("cifar10-simple", **overrides, class_weights=same_as)
        model.capsules[-1].load_state_dict(reference.capsules[-1].state_dict())
        assert torch.equal(model.capsules[-1].route(children, 3)[0], reference.capsules[-1].route(children, 3)[0])
    for bad, message in (
        ({"class_grid": 0}, "class_grid splits the grid the class layer reads"),
        ({"class_grid": side + 1}, f"the class layer reads \\({side}×{side} here\\)"),
        ({"class_grid": 2, "class_weights": "shared"}, "class_weights='per_position'; got 2"),
        ({"class_grid": 2, "capsules": ({"kind": "fc", "types": 4},)}, "none here: an fc capsule layer feeds it"),
    ):
        with pytest.raises(ValueError, match=message):
            capserve.get_config("cifar10-simple", **bad)


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
    transform per position the same run stays at the prior: docs/research/where-things-lie.md.)"""
    data = write_marks(tmp_path / "marks", 100, np.random.default_rng(0), placed=True)
    out = tmp_path / "run"
    with caplog.at_level(logging.INFO, logger="capserve"):
        assert main(["train", "--data", str(data), "--out", str(out), "--epochs", "8"]) == 0
    recorded = json.loads((out / "train_config.json").read_text())
    assert recorded["overrides"] == {
        "class_norm": "joint",
        "backbone_layers": 2,
        "backbone_blocks": 2,
        "class_weights": "shared",
    }
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
    assert json.loads((out / "train_config.json").read_text())["overrides"] == {
        "class_norm": "joint",
        "backbone_layers": 2,
        "backbone_blocks": 2,
        "class_weights": "per_position",
    }
    assert "class capsule transforms" not in caplog.text
    assert capserve.get_config("cifar10-conv").activations


# Marks a model folder as not learned on a disk that fills half-way through the new config.json: the file size limit
# (RLIMIT_FSIZE, its signal ignored) makes every write past that many bytes fail with EFBIG, as a full disk would.
FULL_DISK = """
import resource, signal, sys
from pathlib import Path
from capserve.train.verdict import mark_not_learned
best, limit = Path(sys.argv[1]), int(sys.argv[2])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
try:
    mark_not_learned(best, 0.3, 0.34)
except OSError as e:
    sys.exit(f"failed: {e}")
"""


def test_marking_a_run_not_learned_on_a_full_disk_leaves_best_whole(tmp_path):
    """``best/config.json`` rewritten by the "did not learn" verdict: a write that fails half-way leaves the old
    file, whole and loadable, and no partial file beside it; the next write succeeds."""
    best = save_model(tiny_model("cifar10-simple"), tmp_path / "best")
    before = (best / "config.json").read_bytes()
    result = subprocess.run(
        [sys.executable, "-c", FULL_DISK, str(best), str(len(before) // 2)],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1 and "failed: [Errno 27] File too large" in result.stderr, result.stderr[-2000:]
    assert (best / "config.json").read_bytes() == before
    assert capserve.load(best) is not None and not_learned_warning(best) is None
    assert sorted(p.name for p in best.iterdir()) == ["config.json", "model.safetensors"]
    mark_not_learned(best, 0.3, 0.34)
    assert capserve.load(best) is not None and "did not learn" in not_learned_warning(best)


def fake_run(tmp_path: Path, train_targets: list[int], val_targets: list[int], best_acc: float) -> SimpleNamespace:
    """What ``check_learned`` reads of a finished run (``learned_of``): its folder, its splits' targets, best epoch
    and model config."""
    labels = ("airplane", "automobile", "bird")[: max(train_targets + val_targets) + 1]
    model = tiny_model("cifar10-simple", labels=labels)
    out = tmp_path / "run"
    save_model(model, out / "best")
    (out / "metrics.jsonl").write_text(json.dumps({"epoch": 4, "train_acc": 0.6, "val_acc": best_acc}) + "\n")

    def split(targets: list[int]) -> Split:
        return Split(torch.zeros(len(targets), 3, 2, 2, dtype=torch.uint8), torch.tensor(targets))

    return SimpleNamespace(
        data=SimpleNamespace(train=split(train_targets), val=split(val_targets)),
        state={"best_acc": best_acc, "best_epoch": 4},
        model=model,
        out=out,
    )


def learned_of(run: SimpleNamespace) -> dict | None:
    return check_learned(run.out, run.data, run.state, run.model.config)


def test_the_prior_is_taken_from_the_training_split(tmp_path):
    """Train 60/40, validation 40/60: always answering the training split's most common label scores 40 % on
    validation, so a 62 % model over 100 images learned (the validation split's own majority, 60 %, is not the
    prior: no model could know it)."""
    run = fake_run(tmp_path, [0] * 60 + [1] * 40, [0] * 40 + [1] * 60, 0.62)
    assert learned_of(run) == {"learned": True, "prior": pytest.approx(0.4)}
    assert not_learned_warning(run.out / "best") is None


def test_a_small_split_that_cannot_tell_says_so_and_does_not_fail_a_run_above_the_prior(tmp_path, caplog):
    """300 pictures of 3 classes, 30 for validation: 53.3 % against a prior of 33.3 % is 20 points better, not
    "no better than always answering airplane", but short of the 53.9 % that 30 images take to be clear of chance.
    The run is not failed and best/ is not marked; a run at the prior still is."""
    train_targets, val_targets = [0] * 91 + [1] * 90 + [2] * 89, [0, 1, 2] * 10
    above = fake_run(tmp_path / "above", train_targets, val_targets, 16 / 30)
    with caplog.at_level(logging.WARNING):
        assert learned_of(above) == {"learned": None, "prior": pytest.approx(1 / 3)}
    said = caplog.text
    assert "too small to tell" in said and "no better than" not in said, said
    for figure in ("30 images", "53.3 % (epoch 4)", "always answering airplane (33.3 %", "more than 53.9 %"):
        assert figure in said, (figure, said)
    assert not_learned_warning(above.out / "best") is None
    at = fake_run(tmp_path / "at", train_targets, val_targets, 10 / 30)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert learned_of(at)["learned"] is False
    assert "no better than always answering airplane (33.3 %" in caplog.text
    assert "did not learn" in not_learned_warning(at.out / "best")


@pytest.mark.parametrize(
    ("best", "prior", "n", "learned", "says"),
    [
        (16 / 30, 1 / 3, 30, None, "is above always answering airplane (33.3 %"),
        (14 / 30, 1 / 3, 30, None, "not clear of chance: on 30 images that takes more than 53.9 %"),
        (17 / 30, 1 / 3, 30, True, ""),
        (13 / 30, 1 / 3, 30, False, "is within chance of always answering airplane (33.3 %"),
        (11 / 30, 1 / 3, 30, False, "a model that learned nothing reaches up to 45.3 %"),
        (10 / 30, 1 / 3, 30, False, "is no better than always answering airplane (33.3 %"),
        (9 / 30, 1 / 3, 30, False, "the run did not learn"),
        (0.62, 0.4, 100, True, ""),
        (1.0, 0.4, 5, None, "it takes about 29 validation images at this prior: give --val-size 29"),
        (0.2, 0.4, 5, None, "too small to tell a model that learned from one that did not"),
        (1.0, 1.0, 50, None, "no number of images can at this prior: give a validation split with other answers"),
    ],
)
def test_the_verdict_by_its_figures(best, prior, n, learned, says):
    """Clear of two standard errors and one image above the prior: learned; within one standard error and one image
    of it: did not learn (the best of a few epochs of a model that learned nothing gets that far by chance); between
    the two, or on a split too small for even 100 % to clear the prior: the split cannot tell, and says so."""
    said = verdict(best, prior, n, "airplane", "top-1", 4)
    assert said.learned is learned and says in said.message, said
    if best > prior:
        assert "no better than" not in said.message


def test_nine_validation_images_cannot_tell_and_the_run_does_not_fail(tmp_path, caplog):
    """90 pictures of 3 classes, 9 for validation: 55.6 % against a prior of 44.4 % is within chance (72.1 %), but a
    run that learned could score that low on 9 images too: the split cannot tell, says how many would, and neither
    fails the run nor marks best/."""
    train_targets, val_targets = [2] * 31 + [0] * 25 + [1] * 25, [2] * 4 + [0] * 3 + [1] * 2
    run = fake_run(tmp_path, train_targets, val_targets, 5 / 9)
    with caplog.at_level(logging.WARNING):
        assert learned_of(run) == {"learned": None, "prior": pytest.approx(4 / 9)}
    said = caplog.text
    assert "too small to tell" in said and "did not learn:" not in said and "up to 72.1 % by chance" in said, said
    assert f"give --val-size {images_to_tell(4 / 9)} (or more), a val/ split, or more images" in said
    assert not_learned_warning(run.out / "best") is None


@pytest.mark.parametrize("prior", [4 / 9, 1 / 3, 0.5, 0.1, 0.9])
def test_a_run_at_the_prior_fails_from_the_first_split_that_can_tell(prior):
    """Both sides of the bound: one image fewer than ``images_to_tell``, a run at the prior is not said to have
    failed; from there on it is, and a run that learned (right on half the prior's misses) clears chance there."""
    n = images_to_tell(prior)
    assert 1 < n < 1000
    assert verdict(prior, prior, n - 1, "bird").learned is None
    assert verdict(prior, prior, n, "bird").learned is False
    learned = prior + LEARNED_SHARE * (1 - prior)
    assert learned - 2 * math.sqrt(learned * (1 - learned) / n) > chance_level(prior, n)


@pytest.mark.parametrize(("learned", "code"), [(True, 0), (None, 0), (False, 1)])
def test_only_a_run_at_the_prior_exits_non_zero(tmp_path, monkeypatch, capsys, learned, code):
    """The exit status of ``capserve train`` follows the verdict: a split that cannot tell fails nothing."""
    monkeypatch.setattr(capserve.train.cli, "train", lambda cfg, resume=None: {"learned": learned})
    args = ["train", "--model", "cifar10-simple", "--data", str(tmp_path), "--out", str(tmp_path / "run")]
    assert main(args) == code
