"""A run decides once (``capserve.train.plan``): every data-derived choice is made before the model exists, the
model is built once from the result, and ``train_config.json`` records the choices with their reasons."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from support.data import write_marks
from support.models import tiny_overrides

import capserve
from capserve.data.cache import CACHE_FILE
from capserve.data.preprocess import data_mean_std
from capserve.model.capsnet import CapsNet
from capserve.train.config import TrainConfig
from capserve.train.distributed import Dist
from capserve.train.loop import train
from capserve.train.plan import plan_run

REASONS = {"optimizer", "schedule", "batch_size", "augment", "class_weights", "mean_std"}


@pytest.fixture(scope="module")
def marks(tmp_path_factory) -> Path:
    """Marks anywhere on noise: a run measures its class capsule transforms from them."""
    return write_marks(tmp_path_factory.mktemp("marks") / "marks", 10, np.random.default_rng(0), placed=True)


def own_config(data: Path, out: Path, **kw) -> TrainConfig:
    base = dict(overrides=tiny_overrides("cifar10-conv"), epochs=1, device="cpu", test=False)
    return TrainConfig(model="cifar10-conv", data=str(data), out=str(out), **{**base, **kw})


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
    built = built_configs(monkeypatch)
    out = tmp_path / "run"
    train(own_config(marks, out))
    assert len(built) == 1, [c.class_weights for c in built]
    saved = capserve.read_config(out / "best")
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
    planned = {**dataclasses.asdict(plan.cfg), "out": str(out)}
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
