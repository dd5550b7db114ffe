"""A run decides once (``capserve.train.plan``): every data-derived choice is made before the model exists, the
model is built once from the result, and ``train_config.json`` records the choices with their reasons."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from support.data import write_marks, write_strokes
from support.models import own_config, tiny_overrides

import capserve
from capserve.cli import main
from capserve.configs import get_config
from capserve.data.cache import CACHE_FILE
from capserve.data.preprocess import data_mean_std
from capserve.model.backbones import BasicBlock
from capserve.model.capsnet import CapsNet
from capserve.routing.losses import training_loss
from capserve.train.backbone_loss import BackboneClassifier
from capserve.train.config import AUTO_BACKBONE_LOSS, DEFAULT_LR, TrainConfig, read_resume_config, resolve_recipe
from capserve.train.distributed import Dist
from capserve.train.loop import train
from capserve.train.optimizer import make_optimizer
from capserve.train.plan import RESUMED, plan_run
from capserve.train.rules import label_smoothing

REASONS = {
    "amp",
    "input_size",
    "optimizer",
    "schedule",
    "batch_size",
    "capsule_lr_scale",
    "backbone_loss",
    "backbone_loss_grid",
    "label_smoothing",
    "augment",
    "class_weights",
    "pose",
    "class_norm",
    "backbone_depth",
    "mean_std",
}


def built_configs(monkeypatch) -> list:
    """The config of every capsule network constructed from here on."""
    built = []
    construct = CapsNet.__init__

    def spy(self, config, *args, **kwargs):
        built.append(config)
        construct(self, config, *args, **kwargs)

    monkeypatch.setattr(CapsNet, "__init__", spy)
    return built


def test_the_model_is_built_once_with_its_mean_std_and_class_transforms_already_chosen(marks, tmp_path, monkeypatch):
    """A new run on a user's images chooses its class capsule transforms and its mean/std from the images; the one
    model it builds already has both, and is the model its checkpoints hold."""
    import capserve.train.loop as loop

    built = built_configs(monkeypatch)
    calibrated = []  # how many models were built when the run, trained, calibrates its best/ (which it loads)
    real = loop.calibrate_familiarity
    monkeypatch.setattr(loop, "calibrate_familiarity", lambda *a: calibrated.append(len(built)) or real(*a))
    out = tmp_path / "run"
    train(own_config(marks, out))
    assert calibrated == [1], [c.class_weights for c in built]  # one model trained, built once
    saved = capserve.read_config(out / "best")
    assert built[1:] == [saved]  # then best/ read back as saved, to calibrate its unfamiliarity
    measured = data_mean_std(load_file(str(out / CACHE_FILE))["train.images"])
    assert (built[0].mean, built[0].std) == (saved.mean, saved.std) == (measured["mean"], measured["std"])
    recorded = json.loads((out / "train_config.json").read_text())
    assert built[0].class_weights == saved.class_weights == recorded["overrides"]["class_weights"]


def test_a_plan_gives_the_model_its_run_records(marks, tmp_path):
    """The plan of a config, made on its own, holds the model config the run saves and the choices
    ``train_config.json`` records, reasons included; its model is the same each time it is built."""
    out = tmp_path / "run"
    train(own_config(marks, out))
    plan = plan_run(own_config(marks, tmp_path / "again"), None, Dist(), torch.device("cpu"))
    saved = capserve.read_config(out / "best")
    assert plan.config.to_dict() == {**saved.to_dict(), "extra": {**saved.extra, "name": "again"}}
    recorded = json.loads((out / "train_config.json").read_text())
    assert set(recorded["reasons"]) == REASONS
    planned = {**dataclasses.asdict(plan.cfg), "out": str(out), "input_size": [3, 32, 32]}
    assert {k: v for k, v in recorded.items() if k != "reasons"} == json.loads(json.dumps(planned))
    assert plan.reasons == recorded["reasons"]
    a, b = plan.build_model().state_dict(), plan.build_model().state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_train_config_records_each_choice_resolved_and_why(marks, tmp_path):
    """No choice is left open in ``train_config.json``: the recipe, the batch, the augmentation and the class
    transforms are values, and each says whether it was given, a default, or measured on the images."""
    out = tmp_path / "run"
    train(own_config(marks, out, optimizer="sgd", augment="shift"))
    recorded = json.loads((out / "train_config.json").read_text())
    assert recorded["optimizer"] == "sgd" and recorded["schedule"] == "onecycle" and recorded["augment"] == "shift"
    assert recorded["batch_size"] == 27 and recorded["overrides"]["class_weights"] in ("shared", "per_position")
    reasons = recorded["reasons"]
    assert reasons["optimizer"] == "given" and reasons["augment"] == "given"
    assert reasons["schedule"] == "the default for your own images"
    assert reasons["batch_size"] == "one batch of all 27 training images (fewer than the default 32)"
    assert reasons["mean_std"] == "from the 27 training images"
    assert "where the edges lie" in reasons["class_weights"]
    assert recorded["overrides"]["class_norm"] == "joint" and reasons["class_norm"].startswith("single-label")


def test_an_init_that_cannot_work_fails_before_the_run_folder_exists(marks, tmp_path):
    """``--init`` of a folder that is no model, or a ``--label-map`` that fits neither model nor data: said before
    anything is decoded or written."""
    out = tmp_path / "runs" / "new"
    with pytest.raises(capserve.CheckpointError):
        train(own_config(marks, out, init=str(tmp_path)))
    source = tmp_path / "source"
    train(own_config(marks, source))
    with pytest.raises(ValueError, match="'wolf' is not a label of your data"):
        train(own_config(marks, out, init=str(source / "best"), label_map={"plus": "wolf"}))
    assert not out.exists() and not (tmp_path / "runs").exists()


def test_a_larger_image_size_keeps_the_capsule_grid_of_the_configs_size(marks, tmp_path):
    """``--image-size 64`` on a config made for 32-pixel inputs: the conv backbone max-pools its first layer's output
    by 2, so the capsule layers see the grid (and cost) of a 32-pixel input, the run says why, and the saved model
    answers 64-pixel images. ``--set stem_pool=1`` lets the grid grow; without ``--image-size`` nothing pools."""
    cpu = torch.device("cpu")
    plain = plan_run(own_config(marks, tmp_path / "plain"), None, Dist(), cpu)
    large = plan_run(own_config(marks, tmp_path / "large", image_size=64), None, Dist(), cpu)
    assert plain.config.stem_pool == 1 and "stem_pool" not in plain.reasons
    assert large.config.stem_pool == 2 and large.config.spatial_sizes == plain.config.spatial_sizes
    assert "keeps the capsule grid of a 32-pixel input" in large.reasons["stem_pool"]
    growing = own_config(marks, tmp_path / "grow", image_size=64)
    growing.overrides = {**growing.overrides, "stem_pool": 1}
    grown = plan_run(growing, None, Dist(), cpu)
    assert grown.config.spatial_sizes[0] == 2 * plain.config.spatial_sizes[0] and "stem_pool" not in grown.reasons
    out = tmp_path / "run"
    train(own_config(marks, out, image_size=64))
    model = capserve.load(out / "best")
    assert model.config.stem_pool == 2 and model.config.image_size == 64
    assert model(torch.randn(2, 3, 64, 64)).shape == (2, len(model.config.labels))
    # a fine-tune at 64 pixels of a 32-pixel model pools too, so that its class layer keeps its shape and weights
    source = tmp_path / "source"
    train(own_config(marks, source))
    tuned = plan_run(own_config(marks, tmp_path / "tuned", image_size=64, init=str(source / "best")), None, Dist(), cpu)
    assert tuned.config.stem_pool == 2 and tuned.config.spatial_sizes == plain.config.spatial_sizes


def test_capsule_layers_train_at_the_scaled_lr_and_a_cnn_at_one(marks, tmp_path):
    """``--capsule-lr-scale K``: a capsule network's layers after the backbone step at K times the backbone's lr;
    without it, one lr (the recipe records 1); a CNN baseline, which has no capsule layers, trains at one lr."""
    assert resolve_recipe(own_config(marks, tmp_path / "a"), own_data=True).capsule_lr_scale == 1.0
    assert resolve_recipe(own_config(marks, tmp_path / "b"), own_data=False).capsule_lr_scale == 1.0
    out = tmp_path / "run"
    train(own_config(marks, out, capsule_lr_scale=3.0, backbone_loss=0.0))
    trainer = json.loads((out / "last" / "trainer.json").read_text())
    model = capserve.load(out / "best")
    backbone = len(list(model.backbone.parameters()))
    groups = trainer["param_groups"]
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    in_backbone = [g for g in groups if max(g["params"]) < backbone]
    capsules = [g for g in groups if min(g["params"]) >= backbone]
    assert len(in_backbone) + len(capsules) == len(groups) and in_backbone and capsules
    base = in_backbone[0]["lr"]
    assert base > 0 and all(g["lr"] == pytest.approx(3 * base) for g in capsules)
    assert all(g["lr"] == base for g in in_backbone)
    assert trainer["train_config"]["capsule_lr_scale"] == 3.0
    cnn = tmp_path / "cnn"
    given = dict(epochs=1, device="cpu", test=False, capsule_lr_scale=3.0)
    train(TrainConfig(model="cifar10-conv-cnn", data=str(marks), out=str(cnn), **given))
    lrs = {g["lr"] for g in json.loads((cnn / "last" / "trainer.json").read_text())["param_groups"]}
    assert len(lrs) == 1
    with pytest.raises(ValueError, match="--capsule-lr-scale must be positive"):
        own_config(marks, tmp_path / "c", capsule_lr_scale=0.0)


def test_a_run_recorded_before_capsule_lr_scales_resumes_at_one_lr(marks, tmp_path):
    """A run whose record has no ``capsule_lr_scale`` (and whose optimizer groups have no scale) trained at one lr:
    ``--resume`` continues it at one lr, with its optimizer's state."""
    out = tmp_path / "run"
    train(own_config(marks, out, epochs=2, max_steps=1, capsule_lr_scale=1.0))
    path = out / "last" / "trainer.json"
    trainer = json.loads(path.read_text())
    del trainer["train_config"]["capsule_lr_scale"]
    for group in trainer["param_groups"]:
        del group["lr_scale"]
    path.write_text(json.dumps(trainer))
    summary = train(read_resume_config(out), resume=out)
    assert summary["best_epoch"] is not None
    resumed = json.loads(path.read_text())
    assert resumed["train_config"]["capsule_lr_scale"] == 1.0 and len({g["lr"] for g in resumed["param_groups"]}) == 1


def test_own_images_train_a_backbone_classifier_beside_the_capsules_and_nothing_else_does(marks, tmp_path):
    """``--backbone-loss``: on a user's images a capsule network's backbone also learns from a classifier on its
    pooled features (weight 1, recorded with its reason), which steps at the backbone's lr and is no part of the
    saved model; the built-in data sets keep the paper's recipe (0); a CNN, whose classifier already reads its
    backbone, trains without one, and hears about it when it is given."""
    assert resolve_recipe(own_config(marks, tmp_path / "a"), own_data=False).backbone_loss == 0.0
    out = tmp_path / "run"
    train(own_config(marks, out, capsule_lr_scale=3.0))
    record = json.loads((out / "train_config.json").read_text())
    assert record["backbone_loss"] == 1.0 and record["reasons"]["backbone_loss"] == "the default for your own images"
    trainer = json.loads((out / "last" / "trainer.json").read_text())
    model = capserve.load(out / "best")
    n = len(list(model.parameters()))
    assert load_file(out / "best" / "model.safetensors").keys() == model.state_dict().keys()
    assert sum(len(g["params"]) for g in trainer["param_groups"]) == n + 2  # the classifier's weight and bias
    head = BackboneClassifier(model, 1.0)
    opt = make_optimizer(model, resolve_recipe(own_config(marks, out, capsule_lr_scale=3.0), own_data=True), head)
    scale = {id(p): g["lr_scale"] for g in opt.param_groups for p in g["params"]}
    assert [scale[id(p)] for p in head.parameters()] == [1.0, 1.0]  # the backbone's lr, not the capsules' ×3
    assert {scale[id(p)] for p in model.backbone.parameters()} == {1.0} and 3.0 in scale.values()
    saved = load_file(out / "last" / "optimizer.safetensors")
    width = model.config.backbone_channels
    assert saved["backbone_head.linear.weight"].shape == (len(model.config.labels), width)
    cnn = tmp_path / "cnn"
    train(TrainConfig(model="cifar10-conv-cnn", data=str(marks), out=str(cnn), epochs=1, device="cpu", test=False))
    record = json.loads((cnn / "train_config.json").read_text())
    assert record["backbone_loss"] == 0.0 and "is a CNN" in record["reasons"]["backbone_loss"]
    assert not [k for k in load_file(cnn / "last" / "optimizer.safetensors") if k.startswith("backbone_head")]
    given = TrainConfig(
        model="cifar10-conv-cnn", data=str(marks), out=str(tmp_path / "x"), device="cpu", backbone_loss=0.5
    )
    with pytest.raises(ValueError, match="is a CNN: its own classifier reads its backbone: drop --backbone-loss"):
        train(given)
    with pytest.raises(ValueError, match="--backbone-loss must be a weight >= 0"):
        own_config(marks, tmp_path / "c", backbone_loss=-1.0)


def test_one_label_of_a_users_images_is_smoothed_and_every_other_target_left_whole(marks, tmp_path, monkeypatch):
    """``--label-smoothing``: a single-label capsule run on a user's images trains its capsules and its backbone
    classifier on targets smoothed by 0.1 (recorded with its reason) and validates on the plain cross-entropy; a CNN
    and the built-in data sets take none unless given; multi-label targets, and dynamic routing's margin loss, take
    none, and a user who gives it there hears why."""
    smoothing = []
    cross_entropy = torch.nn.functional.cross_entropy

    def spy(*args, **kwargs):
        smoothing.append((torch.is_grad_enabled(), kwargs.get("label_smoothing", 0.0)))
        return cross_entropy(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "cross_entropy", spy)
    out = tmp_path / "run"
    train(own_config(marks, out, val_size=3))
    record = json.loads((out / "train_config.json").read_text())
    assert (record["label_smoothing"], record["reasons"]["label_smoothing"]) == (0.1, "the default for your own images")
    assert [eps for grad, eps in smoothing if grad] == [0.1, 0.1]  # one step: the capsules' loss, the classifier's
    assert {eps for grad, eps in smoothing if not grad} == {0.0}  # validation
    logits, targets = torch.randn(5, 4), torch.tensor([0, 3, 1, 1, 2])
    smoothed = training_loss(capserve.read_config(out / "best"), 0.1)(logits, targets, False, 1.0)
    log_p = logits.log_softmax(1)
    expected = -(0.9 * log_p.gather(1, targets[:, None]).squeeze(1) + 0.1 * log_p.mean(1)).mean()
    assert smoothed.item() == pytest.approx(expected.item(), rel=1e-5)
    given = plan_run(own_config(marks, tmp_path / "given", label_smoothing=0.0), None, Dist(), torch.device("cpu"))
    assert (given.cfg.label_smoothing, given.reasons["label_smoothing"]) == (0.0, "given")
    cnn = own_config(marks, tmp_path / "cnn", model="cifar10-conv-cnn", overrides=tiny_overrides("cifar10-conv-cnn"))
    plan = plan_run(cnn, None, Dist(), torch.device("cpu"))
    assert (plan.cfg.label_smoothing, plan.reasons["label_smoothing"]) == (
        0.0,
        "cifar10-conv-cnn is a CNN: smoothing helped the capsules on the battery, not it",
    )
    plan = plan_run(dataclasses.replace(cnn, label_smoothing=0.1), None, Dist(), torch.device("cpu"))
    assert (plan.cfg.label_smoothing, plan.reasons["label_smoothing"]) == (0.1, "given")
    builtin = get_config("cifar10-conv")
    assert label_smoothing(own_config(marks, out), builtin, own=False)[0].label_smoothing == 0.0
    multi = dataclasses.replace(builtin, task="multi_label")
    cfg, why = label_smoothing(own_config(marks, out), multi, own=True)
    assert cfg.label_smoothing == 0.0 and why.startswith("multi-label")
    with pytest.raises(ValueError, match="multi-label targets say of each label on its own .*: drop it"):
        label_smoothing(own_config(marks, out, label_smoothing=0.1), multi, own=True)
    rows = ["image,labels"] + [f"{p.relative_to(marks.parent)},{p.parent.name} x" for p in marks.rglob("*.png")]
    (marks.parent / "two-labels.csv").write_text("\n".join(rows) + "\n")
    args = ["--data", str(marks.parent / "two-labels.csv"), "--out", str(tmp_path / "two"), "--label-smoothing", "0.1"]
    assert main(["train", *args]) == 2 and not (tmp_path / "two").exists()  # refused before anything is written
    dynamic = get_config("cifar10-simple-dynamic")
    assert label_smoothing(own_config(marks, out), dynamic, own=True)[0].label_smoothing == 0.0
    with pytest.raises(ValueError, match="dynamic routing trains with its own paper's loss: drop it"):
        label_smoothing(own_config(marks, out, label_smoothing=0.2), dynamic, own=True)
    with pytest.raises(ValueError, match="dynamic routing trains with its own paper's loss"):
        training_loss(dynamic, 0.1)
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match=r"--label-smoothing must be in \[0, 1\)"):
            own_config(marks, out, label_smoothing=bad)


def test_the_backbone_classifier_keeps_where_things_lie_where_the_labels_follow_it(marks, tmp_path):
    """``--backbone-loss-grid``: the backbone classifier pools the backbone's map to 4×4 where the run's class
    capsule transforms are per position (the labels follow where things lie), globally where they are shared; as
    given with the flag; recorded with its reason; and a mistake the user hears about on a run without the loss or
    finer than the backbone's map."""
    rng = np.random.default_rng(1)
    centred = write_marks(tmp_path / "centred", 10, rng, placed=False)
    runs = {"anywhere": marks, "centred": centred, "given": marks}
    expected = {
        "anywhere": ("shared", 1, "the class layer's transforms are shared"),
        "centred": ("per_position", 4, "the class layer's transforms are per position"),
        "given": ("shared", 3, "given"),
    }
    for name, data in runs.items():
        out = tmp_path / name
        if name == "given":  # the flag, as a user gives it
            args = ["--data", str(data), "--out", str(out), "--epochs", "1", "--max-steps", "1", "--no-test"]
            assert main(["train", *args, "--backbone-loss-grid", "3"]) in (0, 1)
        else:
            train(own_config(data, out, max_steps=1))
        record = json.loads((out / "train_config.json").read_text())
        weights, grid, reason = expected[name]
        assert record["overrides"]["class_weights"] == weights
        assert (record["backbone_loss_grid"], record["reasons"]["backbone_loss_grid"]) == (grid, reason)
        model = capserve.load(out / "best")
        head = load_file(out / "last" / "optimizer.safetensors")["backbone_head.linear.weight"]
        assert head.shape == (len(model.config.labels), model.config.backbone_channels * grid * grid)
    with pytest.raises(ValueError, match="--backbone-loss-grid pools the backbone loss's classifier"):
        train(own_config(marks, tmp_path / "none", backbone_loss=0.0, backbone_loss_grid=2))
    with pytest.raises(ValueError, match="--backbone-loss-grid must be >= 1"):
        own_config(marks, tmp_path / "zero", backbone_loss_grid=0)
    side = model.config.feature_size
    with pytest.raises(ValueError, match=f"finer than the backbone's {side}×{side} map: give at most {side}"):
        train(own_config(marks, tmp_path / "finer", backbone_loss_grid=side + 1))


def test_a_run_recorded_before_the_classifier_grid_and_label_smoothing_resumes_as_it_trained(tmp_path):
    """A run whose record has no ``backbone_loss_grid`` trained its backbone classifier on a global average pool,
    whatever its class transforms, and one with no ``label_smoothing`` on whole labels: ``--resume`` continues that
    classifier, with its optimizer state, on whole labels."""
    centred = write_marks(tmp_path / "centred", 10, np.random.default_rng(1), placed=False)
    out = tmp_path / "run"
    train(own_config(centred, out, epochs=2, max_steps=1, backbone_loss_grid=1))
    for path in (out / "last" / "trainer.json", out / "train_config.json"):
        record = json.loads(path.read_text())
        del record.get("train_config", record)["backbone_loss_grid"]
        del record.get("train_config", record)["label_smoothing"]
        path.write_text(json.dumps(record))
    before = load_file(out / "last" / "optimizer.safetensors")["backbone_head.linear.weight"]
    summary = train(read_resume_config(out), resume=out)
    assert summary["best_epoch"] is not None
    after = load_file(out / "last" / "optimizer.safetensors")["backbone_head.linear.weight"]
    assert after.shape == before.shape and not torch.equal(after, before)  # the same classifier, trained on
    resumed = json.loads((out / "last" / "trainer.json").read_text())["train_config"]
    assert (resumed["backbone_loss_grid"], resumed["label_smoothing"]) == (1, 0.0)
    assert json.loads((out / "train_config.json").read_text())["reasons"]["backbone_loss_grid"] == RESUMED


def test_the_class_capsules_share_one_layernorm_where_one_label_answers(marks, tmp_path):
    """A new run on a user's images normalises its class capsules together on single-label data and each alone on
    multi-label data (each label answers on its own); ``--set class_norm=...`` decides instead."""
    cpu, dist = torch.device("cpu"), Dist()
    rows = ["image,labels"] + [
        f"{p.relative_to(marks.parent)},{p.parent.name} x{i % 2}" for i, p in enumerate(marks.rglob("*.png"))
    ]
    (marks.parent / "multi.csv").write_text("\n".join(rows) + "\n")
    multi = plan_run(own_config(marks.parent / "multi.csv", tmp_path / "multi"), None, dist, cpu)
    single = plan_run(own_config(marks, tmp_path / "single"), None, dist, cpu)
    assert multi.config.task == "multi_label" and single.config.task == "single_label"
    assert (multi.config.class_norm, single.config.class_norm) == ("per_class", "joint")
    assert multi.cfg.overrides["class_norm"] == "per_class" and multi.reasons["class_norm"].startswith("multi-label")
    given = {**tiny_overrides("cifar10-conv"), "class_norm": "per_class"}
    plan = plan_run(own_config(marks, tmp_path / "given", overrides=given), None, dist, cpu)
    assert plan.config.class_norm == "per_class" and plan.reasons["class_norm"] == "given"
    assert single.build_model().capsules[-1].norm.weight.shape == (len(single.config.labels), 16)


def test_a_capsule_network_on_own_multi_label_images_takes_a_batch_of_16_at_half_the_lr(marks, tmp_path):
    """Without --batch-size, a capsule network on a user's multi-label images trains at batch 16 and half the
    optimizer's lr (the same step per image), and says why; the CNN baseline there, and any run on single-label
    images, at 32 and the optimizer's lr (the batch fitted to fewer images); a given batch or lr wins; the built-in
    multi-label set keeps the paper's 128."""
    cpu, dist = torch.device("cpu"), Dist()
    rows = ["image,labels"] + [
        f"{p.relative_to(marks.parent)},{p.parent.name} x{i % 2}" for i, p in enumerate(marks.rglob("*.png"))
    ]
    csv = marks.parent / "multi.csv"
    csv.write_text("\n".join(rows) + "\n")
    capsules = plan_run(own_config(csv, tmp_path / "capsules"), None, dist, cpu)
    assert (capsules.cfg.batch_size, capsules.cfg.lr) == (16, DEFAULT_LR["adamw"] / 2)
    assert capsules.reasons["batch_size"] == "the default for a capsule network on your own multi-label images"
    cnn = own_config(csv, tmp_path / "cnn", model="cifar10-conv-cnn", overrides=tiny_overrides("cifar10-conv-cnn"))
    single = own_config(marks, tmp_path / "single")
    for other in (cnn, single):  # the default 32 fitted to the few images
        plan = plan_run(other, None, dist, cpu)
        assert plan.reasons["batch_size"].endswith("(fewer than the default 32)")
        assert plan.cfg.lr == DEFAULT_LR["adamw"]
    given = plan_run(own_config(csv, tmp_path / "given", batch_size=8, lr=3e-3), None, dist, cpu)
    assert (given.cfg.batch_size, given.cfg.lr, given.reasons["batch_size"]) == (8, 3e-3, "given")


def test_a_given_batch_larger_than_the_training_set_is_refused_not_shrunk(marks, tmp_path, capsys):
    """Only the default batch is fitted to a small data set; one the user gave is what they asked for, so more than
    the training images is an error that says both figures (exit 2, one line)."""
    from capserve.cli import main

    with pytest.raises(ValueError, match=r"^--batch-size 64 exceeds the 27 training images per epoch$"):
        plan_run(own_config(marks, tmp_path / "planned", batch_size=64), None, Dist(), torch.device("cpu"))
    assert main(["train", "--data", str(marks), "--out", str(tmp_path / "run"), "--batch-size", "64"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "capserve train: error: --batch-size 64 exceeds the 27 training images per epoch"
    builtin = resolve_recipe(own_config(marks, tmp_path / "builtin"), own_data=False, multi_label_capsules=True)
    assert (builtin.batch_size, builtin.lr) == (128, DEFAULT_LR["sgd"])


def test_a_new_run_on_own_images_puts_residual_blocks_in_front_of_the_capsules(marks, tmp_path):
    """A new capsule run on a user's images builds its conv backbone as two conv layers and two residual blocks, and
    records that in its overrides; ``--set backbone_layers=N`` (or ``backbone_blocks``) decides instead, and a CNN
    keeps the config's backbone."""
    cpu, dist = torch.device("cpu"), Dist()
    plan = plan_run(own_config(marks, tmp_path / "own"), None, dist, cpu)
    assert (plan.config.backbone_layers, plan.config.backbone_blocks) == (2, 2)
    assert plan.cfg.overrides["backbone_blocks"] == 2 and plan.reasons["backbone_depth"].startswith("your own images")
    assert sum(isinstance(m, BasicBlock) for m in plan.build_model().backbone) == 2
    given = {**tiny_overrides("cifar10-conv"), "backbone_layers": 3}
    plan = plan_run(own_config(marks, tmp_path / "given", overrides=given), None, dist, cpu)
    assert (plan.config.backbone_layers, plan.config.backbone_blocks) == (3, 0) and plan.reasons[
        "backbone_depth"
    ] == "given"
    cnn = own_config(marks, tmp_path / "cnn", model="cifar10-conv-cnn", overrides=tiny_overrides("cifar10-conv-cnn"))
    plan = plan_run(cnn, None, dist, cpu)
    assert (plan.config.backbone_layers, plan.config.backbone_blocks) == (3, 0)
    assert plan.reasons["backbone_depth"] == "the model config's"


def test_class_transforms_per_position_are_shared_within_the_cells_of_a_2x2_grid(tmp_path):
    """Where a user's labels follow where things lie, a new run keeps the class transforms per position at the
    resolution of a 2×2 grid of cells (``class_grid``), recorded in its overrides with the reason, and ``--resume``
    rebuilds it; ``--set class_grid=N`` decides instead, and objects anywhere keep transforms shared by every
    position."""
    centred = write_marks(tmp_path / "centred", 10, np.random.default_rng(1), placed=False)
    out = tmp_path / "run"
    train(own_config(centred, out, epochs=2, max_steps=1))
    record = json.loads((out / "train_config.json").read_text())
    side = capserve.read_config(out / "last").spatial_sizes[-1]
    assert (record["overrides"]["class_weights"], record["overrides"]["class_grid"]) == ("per_position", 2)
    assert record["reasons"]["class_weights"].endswith(
        f"one per type in each cell of a 2×2 grid over the class layer's {side}×{side} children"
    )
    train(read_resume_config(out), resume=out)
    assert capserve.read_config(out / "last").class_grid == 2
    cpu, dist = torch.device("cpu"), Dist()
    given = plan_run(
        own_config(centred, tmp_path / "given", overrides={**tiny_overrides("cifar10-conv"), "class_grid": 3}),
        None,
        dist,
        cpu,
    )
    assert (given.config.class_weights, given.config.class_grid, given.reasons["class_weights"]) == (
        "per_position",
        3,
        "given",
    )
    anywhere = write_marks(tmp_path / "anywhere", 10, np.random.default_rng(0), placed=True)
    plan = plan_run(own_config(anywhere, tmp_path / "anywhere-run"), None, dist, cpu)
    assert (plan.config.class_weights, plan.config.class_grid) == ("shared", None)


def test_multi_label_images_whose_labels_follow_where_things_lie_take_vector_poses_and_shared_class_transforms(
    tmp_path,
):
    """Where several labels may answer and they follow where things lie, a new capsule run takes vector poses and
    one class transform per type wherever it lies (the backbone classifier keeps the 4×4 grid of such labels),
    records both with the reason, and ``--resume`` rebuilds that model; ``--set pose='"matrix"'`` keeps matrices
    with transforms per cell; single-label images, and labels that do not follow where things lie, keep matrices."""
    cpu, dist = torch.device("cpu"), Dist()
    centred = write_marks(tmp_path / "centred", 10, np.random.default_rng(1), placed=False)
    anywhere = write_marks(tmp_path / "anywhere", 10, np.random.default_rng(0), placed=True)
    csvs = {}
    for name, folder in (("centred", centred), ("anywhere", anywhere)):
        rows = ["image,labels"] + [f"{p.relative_to(tmp_path)},{p.parent.name}" for p in folder.rglob("*.png")]
        csvs[name] = tmp_path / f"{name}.csv"
        csvs[name].write_text("\n".join(rows) + "\n")
    out = tmp_path / "run"
    train(own_config(csvs["centred"], out, epochs=2, max_steps=1))
    record = json.loads((out / "train_config.json").read_text())
    chosen = {k: record["overrides"][k] for k in ("class_weights", "class_grid", "pose")}
    assert chosen == {"class_weights": "per_position", "class_grid": 1, "pose": "vector"}
    assert record["reasons"]["pose"].startswith("several labels answer and they follow where things lie")
    assert (record["backbone_loss_grid"], record["reasons"]["backbone_loss_grid"]) == (
        4,
        "the class layer's transforms are per position in one cell, one per type wherever it lies",
    )
    config = capserve.read_config(out / "last")
    assert (config.pose, config.class_grid) == ("vector", 1)
    train(read_resume_config(out), resume=out)
    assert capserve.read_config(out / "last").pose == "vector"
    matrices = {**tiny_overrides("cifar10-conv"), "pose": "matrix"}
    given = plan_run(own_config(csvs["centred"], tmp_path / "given", overrides=matrices), None, dist, cpu)
    assert (given.config.pose, given.config.class_weights, given.config.class_grid) == ("matrix", "per_position", 2)
    assert given.reasons["pose"] == "given"
    for data, weights in ((centred, "per_position"), (csvs["anywhere"], "shared")):
        plan = plan_run(own_config(data, tmp_path / f"{data.stem}-plan"), None, dist, cpu)
        assert (plan.config.pose, plan.config.class_weights) == ("matrix", weights)
        assert plan.reasons["pose"] == "the model config's"


def test_a_resumed_run_rebuilds_its_model_and_one_recorded_before_the_own_images_choices_its_first_one(marks, tmp_path):
    """``--resume`` rebuilds the class capsules' LayerNorm and the backbone the run chose (recorded in its overrides);
    a run whose records have neither built each class capsule's LayerNorm alone (the paper's) on three conv layers,
    and resumes so."""
    out = tmp_path / "run"
    train(own_config(marks, out, epochs=2, max_steps=1))
    summary = train(read_resume_config(out), resume=out)
    resumed = capserve.read_config(out / "last")
    assert summary["best_epoch"] is not None and resumed.class_norm == "joint" and resumed.backbone_blocks == 2
    before = tmp_path / "before"
    first = {"class_norm": "per_class", "backbone_layers": 3, "backbone_blocks": 0}
    train(own_config(marks, before, epochs=2, max_steps=1, overrides={**tiny_overrides("cifar10-conv"), **first}))
    for path in (before / "last" / "trainer.json", before / "train_config.json"):
        record = json.loads(path.read_text())
        overrides = record.get("train_config", record)["overrides"]
        for field in first:
            del overrides[field]
        path.write_text(json.dumps(record))
    for folder in (before / "last", before / "best"):
        record = json.loads((folder / "config.json").read_text())
        for field in first:
            del record["config"][field]
        (folder / "config.json").write_text(json.dumps(record))
    summary = train(read_resume_config(before), resume=before)
    resumed = capserve.read_config(before / "last")
    assert summary["best_epoch"] is not None
    assert (resumed.class_norm, resumed.backbone_layers, resumed.backbone_blocks) == ("per_class", 3, 0)


def test_a_run_on_many_classes_starts_its_class_transforms_at_ten_classes_scale(tmp_path):
    """More than 10 labels of a user's: the class capsule transforms start at the authors' init for 10 classes
    (``init_classes``, recorded with its reason); up to 10, and with ``--set init_classes=N``, as the config says."""
    rng = np.random.default_rng(0)
    for split, n in (("train", 3), ("test", 1)):
        for label in range(12):
            folder = tmp_path / "many" / split / f"c{label}"
            folder.mkdir(parents=True)
            for i in range(n):
                Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    cpu = torch.device("cpu")
    plan = plan_run(own_config(tmp_path / "many", tmp_path / "a", val_size=0), None, Dist(), cpu)
    assert plan.config.init_classes == 10 and "12 classes" in plan.reasons["init_classes"]
    theirs = dataclasses.replace(plan, config=dataclasses.replace(plan.config, init_classes=None))
    ratio = plan.build_model().capsules[-1].weight.std() / theirs.build_model().capsules[-1].weight.std()
    assert ratio.item() == pytest.approx((10 / 12) ** 0.5, rel=1e-3)
    overrides = {**tiny_overrides("cifar10-conv"), "init_classes": 12}
    given = own_config(tmp_path / "many", tmp_path / "b", val_size=0, overrides=overrides)
    assert plan_run(given, None, Dist(), cpu).config.init_classes == 12


def write_classes(root: Path, classes: int, per_class: int) -> Path:
    """A folder of ``classes`` label folders with ``per_class`` small noise pictures each."""
    rng = np.random.default_rng(0)
    for label in range(classes):
        folder = root / f"c{label:03d}"
        folder.mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    return root


def test_many_classes_from_few_images_train_with_more_decay_smoothing_and_depth(tmp_path):
    """More than 10 labels with fewer than 64 training images each: a new capsule run takes weight decay 0.5, label
    smoothing 0.2 and four residual blocks after three conv layers, each recorded with why; what the user gives
    stays, and 10 labels, 64 images a label, multi-label images and a CNN keep the usual choices."""
    cpu, dist = torch.device("cpu"), Dist()
    few = write_classes(tmp_path / "few", 11, 63)
    plan = plan_run(own_config(few, tmp_path / "a", val_size=0), None, dist, cpu)
    assert (plan.cfg.weight_decay, plan.cfg.label_smoothing, plan.config.backbone_blocks) == (0.5, 0.2, 4)
    assert plan.config.backbone_layers == 3
    assert plan.reasons["few_images"] == "11 classes from 63 training images a class"
    assert plan.reasons["label_smoothing"] == plan.reasons["weight_decay"] == plan.reasons["few_images"]
    assert plan.reasons["backbone_depth"].startswith(plan.reasons["few_images"])
    assert sum(isinstance(m, BasicBlock) for m in plan.build_model().backbone) == 4
    plan.record(tmp_path / "a")
    recorded = json.loads((tmp_path / "a" / "train_config.json").read_text())
    assert (recorded["weight_decay"], recorded["label_smoothing"], recorded["overrides"]["backbone_blocks"]) == (
        0.5,
        0.2,
        4,
    )
    assert recorded["reasons"]["few_images"] == plan.reasons["few_images"]

    given = own_config(
        few,
        tmp_path / "given",
        val_size=0,
        weight_decay=0.01,
        label_smoothing=0.05,
        overrides={**tiny_overrides("cifar10-conv"), "backbone_blocks": 1},
    )
    plan = plan_run(given, None, dist, cpu)
    assert (plan.cfg.weight_decay, plan.cfg.label_smoothing, plan.config.backbone_blocks) == (0.01, 0.05, 1)
    assert plan.reasons["label_smoothing"] == plan.reasons["backbone_depth"] == "given"
    layers = own_config(
        few, tmp_path / "layers", val_size=0, overrides={**tiny_overrides("cifar10-conv"), "backbone_layers": 2}
    )
    plan = plan_run(layers, None, dist, cpu)  # the layers alone given: the blocks stay the config's, not the rule's
    default_blocks = capserve.get_config("cifar10-conv").backbone_blocks
    assert (plan.config.backbone_layers, plan.config.backbone_blocks) == (2, default_blocks) != (3, 4)
    assert plan.reasons["backbone_depth"] == "given" and plan.cfg.weight_decay == 0.5  # the rest of the rule holds

    usual = (0.05, 0.1, 2)
    for name, classes, per_class in (("ten", 10, 3), ("enough", 11, 64)):
        data = write_classes(tmp_path / name, classes, per_class)
        plan = plan_run(own_config(data, tmp_path / f"run-{name}", val_size=0), None, dist, cpu)
        assert (plan.cfg.weight_decay, plan.cfg.label_smoothing, plan.config.backbone_blocks) == usual
        assert "few_images" not in plan.reasons
    rows = ["image,labels"]
    for i, path in enumerate(sorted(few.glob("*/*.png"))[:120]):
        rows.append(f"{path.relative_to(tmp_path).as_posix()},c{i % 11} c{(i + 1) % 11}")
    (tmp_path / "multi.csv").write_text("\n".join(rows) + "\n")
    plan = plan_run(own_config(tmp_path / "multi.csv", tmp_path / "run-multi", val_size=0), None, dist, cpu)
    assert plan.cfg.weight_decay != 0.5 and plan.config.backbone_blocks == 2 and "few_images" not in plan.reasons
    cnn = own_config(few, tmp_path / "cnn", val_size=0, model="cifar10-conv-cnn", overrides={})
    plan = plan_run(dataclasses.replace(cnn, overrides=tiny_overrides("cifar10-conv-cnn")), None, dist, cpu)
    assert (plan.cfg.weight_decay, plan.cfg.label_smoothing, plan.config.backbone_blocks) == (0.05, 0.0, 0)


def test_few_pictures_that_a_mirror_keeps_are_shifted_and_mirrored(tmp_path):
    """Fewer than 64 training pictures a label of things in their place whose labels survive a mirror: a new capsule
    run without --augment takes crop-flip, recorded with why; pictures a mirror relabels, things anywhere, 64 a label,
    a given --augment, a CNN and multi-label images keep the usual none."""
    cpu, dist, rng = torch.device("cpu"), Dist(), np.random.default_rng(0)
    marks = write_marks(tmp_path / "marks", 30, rng, placed=False)
    plan = plan_run(own_config(marks, tmp_path / "a", val_size=0), None, dist, cpu)
    assert plan.cfg.augment == "crop-flip"
    assert plan.reasons["augment"].startswith(
        "30 training images a class, the labels follow where things lie, and the labels survive a mirror"
    )
    plan.record(tmp_path / "a")
    recorded = json.loads((tmp_path / "a" / "train_config.json").read_text())
    assert (recorded["augment"], recorded["reasons"]["augment"]) == ("crop-flip", plan.reasons["augment"])

    strokes = write_strokes(tmp_path / "strokes", 30, rng)
    enough = write_marks(tmp_path / "enough", 64, rng, placed=False)
    anywhere = write_marks(tmp_path / "anywhere", 30, rng, placed=True)
    for name, data, kw in (
        ("strokes", strokes, {}),
        ("anywhere", anywhere, {}),
        ("enough", enough, {}),
        ("given", marks, {"augment": "none"}),
        ("cnn", marks, {"model": "cifar10-simple-cnn", "overrides": {}}),
    ):
        plan = plan_run(own_config(data, tmp_path / f"run-{name}", val_size=0, **kw), None, dist, cpu)
        assert plan.cfg.augment == "none", name
        assert "labels survive a mirror" not in plan.reasons["augment"], name
    why = plan_run(own_config(strokes, tmp_path / "why", val_size=0), None, dist, cpu).reasons["augment"]
    assert why.startswith("30 training images a class, but the labels may not survive a mirror")
    why = plan_run(own_config(anywhere, tmp_path / "why-anywhere", val_size=0), None, dist, cpu).reasons["augment"]
    assert why.startswith("30 training images a class, but the labels do not follow where things lie")
    rows = ["image,labels"] + [
        f"{path.relative_to(tmp_path).as_posix()},{path.parent.name} extra{i % 2}"
        for i, path in enumerate(sorted(marks.glob("*/*.png")))
    ]
    (tmp_path / "multi.csv").write_text("\n".join(rows) + "\n")
    plan = plan_run(own_config(tmp_path / "multi.csv", tmp_path / "run-multi", val_size=0), None, dist, cpu)
    assert plan.cfg.augment == "none"


def test_small_things_anywhere_max_pool_the_stem_in_place_of_the_stride(marks, tmp_path):
    """Marks anywhere on a plain ground (small things anywhere): a new capsule run max-pools its first layer's output
    by 2 in place of the second layer's stride, at the same capsule grid, says why, records both in its overrides,
    and ``--resume`` rebuilds that model. Marks on noise (their edges fill the picture), a given stride, a CNN
    baseline and multi-label images keep the stride; at ``--image-size 64`` the pool takes over both."""
    cpu, dist = torch.device("cpu"), Dist()
    small = write_marks(tmp_path / "small", 10, np.random.default_rng(0), placed=True, plain=True)
    pooled = plan_run(own_config(small, tmp_path / "pooled"), None, dist, cpu)
    strided = plan_run(own_config(marks, tmp_path / "strided"), None, dist, cpu)
    assert (pooled.config.stem_pool, pooled.config.backbone_stride) == (2, 1)
    assert (strided.config.stem_pool, strided.config.backbone_stride) == (1, 2) and "stem_pool" not in strided.reasons
    assert pooled.config.spatial_sizes == strided.config.spatial_sizes
    assert pooled.reasons["stem_pool"].startswith("the labels are small things anywhere")
    given = own_config(small, tmp_path / "given", overrides={**tiny_overrides("cifar10-conv"), "backbone_stride": 2})
    assert plan_run(given, None, dist, cpu).config.stem_pool == 1
    cnn = own_config(small, tmp_path / "cnn", model="cifar10-conv-cnn", overrides=tiny_overrides("cifar10-conv-cnn"))
    assert plan_run(cnn, None, dist, cpu).config.backbone_stride == 2
    rows = ["image,labels"] + [f"{p.relative_to(tmp_path)},{p.parent.name}" for p in small.rglob("*.png")]
    (tmp_path / "small.csv").write_text("\n".join(rows) + "\n")
    multi = plan_run(own_config(tmp_path / "small.csv", tmp_path / "multi"), None, dist, cpu)
    assert multi.config.task == "multi_label" and multi.config.backbone_stride == 2
    large = plan_run(own_config(small, tmp_path / "large", image_size=64), None, dist, cpu)
    assert (large.config.stem_pool, large.config.backbone_stride) == (4, 1)
    assert large.config.spatial_sizes == strided.config.spatial_sizes
    out = tmp_path / "run"
    train(own_config(small, out, epochs=2, max_steps=1))
    record = json.loads((out / "train_config.json").read_text())
    assert (record["overrides"]["stem_pool"], record["overrides"]["backbone_stride"]) == (2, 1)
    train(read_resume_config(out), resume=out)
    model = capserve.load(out / "last")
    assert (model.config.stem_pool, model.config.backbone_stride) == (2, 1)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 3)


def test_small_things_anywhere_train_with_twice_the_backbone_loss(marks, tmp_path):
    """The run whose stem the max-pool takes trains with twice the backbone loss of other runs on a user's images, says
    why, and records it, so that ``--resume`` keeps it; a given ``--backbone-loss``, a strided stem and a CNN baseline
    keep theirs."""
    cpu, dist = torch.device("cpu"), Dist()
    small = write_marks(tmp_path / "small", 10, np.random.default_rng(0), placed=True, plain=True)
    pooled = plan_run(own_config(small, tmp_path / "pooled"), None, dist, cpu)
    assert pooled.cfg.backbone_loss == AUTO_BACKBONE_LOSS["own small things"] == 2 * AUTO_BACKBONE_LOSS["own"]
    assert "small things anywhere" in pooled.reasons["backbone_loss"]
    strided = plan_run(own_config(marks, tmp_path / "strided"), None, dist, cpu)
    assert strided.cfg.backbone_loss == AUTO_BACKBONE_LOSS["own"]
    assert strided.reasons["backbone_loss"] == "the default for your own images"
    given = plan_run(own_config(small, tmp_path / "given", backbone_loss=0.5), None, dist, cpu)
    assert (given.config.stem_pool, given.cfg.backbone_loss, given.reasons["backbone_loss"]) == (2, 0.5, "given")
    kept = own_config(small, tmp_path / "kept", overrides={**tiny_overrides("cifar10-conv"), "backbone_stride": 2})
    assert plan_run(kept, None, dist, cpu).cfg.backbone_loss == AUTO_BACKBONE_LOSS["own"]
    cnn = own_config(small, tmp_path / "cnn", model="cifar10-conv-cnn", overrides=tiny_overrides("cifar10-conv-cnn"))
    assert plan_run(cnn, None, dist, cpu).cfg.backbone_loss == 0
    out = tmp_path / "run"
    train(own_config(small, out, epochs=2, max_steps=1))
    assert json.loads((out / "train_config.json").read_text())["backbone_loss"] == 2
    assert plan_run(read_resume_config(out), out, dist, cpu).cfg.backbone_loss == 2
