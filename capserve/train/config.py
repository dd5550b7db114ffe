"""``TrainConfig``: every choice of a training run, as data (written to ``train_config.json``), and the
learning-rate schedules."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from capserve.configs import list_models
from capserve.data.augment import AUGMENTATIONS
from capserve.files import recover_directory

SCHEDULES = ("step", "cosine", "onecycle")


AMP = {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}
AMP_CHOICES = ("auto", *AMP)  # --amp: "auto" chooses among "off" (fp32) and "bf16" by measuring (capserve.train.amp)


# "auto" picks per data (``resolve_recipe``): the authors' SGD for the built-in data sets, AdamW for a user's images
OPTIMIZERS = ("auto", "sgd", "adam", "adamw")


FREEZE = ("backbone",)  # parts of the model that --freeze keeps at their --init values


DEFAULT_LR = {"sgd": 0.1, "adam": 1e-3, "adamw": 2e-3}


WARMUP = 0.15  # one-cycle warm-up fraction


MILESTONES = (150 / 350, 250 / 350)  # the authors' step epochs as fractions of the run


DEFAULT_VAL_SIZE = {"builtin": 5000, "own": 0.1}  # images for CIFAR/MNIST; a fraction of a user's training images


# Weight decay without --weight-decay, per optimizer. SGD and Adam add it to the gradient (L2, coupled to the lr and,
# for Adam, rescaled per parameter); AdamW shrinks the weights directly (decoupled, Loshchilov & Hutter 2019), which
# is why its value is two orders larger for a similar pull. A strong coupled L2 under SGD at lr 0.1 holds a small
# model at the label prior on a user's few thousand images (docs/research/own-data-battery.md), so SGD keeps the
# authors' value everywhere.
DEFAULT_WEIGHT_DECAY = {"sgd": 5e-4, "adam": 5e-4, "adamw": 5e-2}


# What "auto" means for each kind of data: the paper's recipe for CIFAR and DiverseMultiMNIST (its results are
# reproduced with it), and for a user's images the recipe of a short run on little data, the one that learns on every
# set of the own-data battery: AdamW with a linear warm-up into a cosine decay.
AUTO_RECIPE = {"builtin": ("sgd", "step"), "own": ("adamw", "onecycle")}


# The batch without --batch-size: the authors' 128 for the built-in data sets; 32 for a user's images, whose few
# thousand images make few steps per epoch (short runs learn from the number of steps, not of epochs), and 16 for a
# capsule network on a user's multi-label images, at the lr that keeps the step per image (Goyal et al.'s linear
# scaling): there the capsules sit at the label prior for much of a short run, and twice the steps at half the size
# let them leave it sooner and climb further; the CNN baseline gains nothing from the batch
# (docs/research/multi-label.md)
AUTO_BATCH_SIZE = {"builtin": 128, "own": 32, "own multi-label capsules": 16}


# The lr of a capsule network's capsule layers (primary capsules, routed layers, logit read-out) as a multiple of the
# backbone's, without --capsule-lr-scale: one lr everywhere. A larger step for the capsule layers helps short runs on
# many classes and lengthens the plateau at the prior that others start on (docs/research/capsules-beside-the-cnn.md),
# so it is the user's choice, not a default. A CNN baseline has no capsule layers: one lr.
AUTO_CAPSULE_LR_SCALE = {"builtin": 1.0, "own": 1.0}


# The weight of the training-only backbone classifier's loss (``capserve.train.backbone_loss``) beside a capsule
# network's, without --backbone-loss: on a user's images, where short runs left the capsules behind the CNN, it helped
# across the battery (docs/research/capsules-beside-the-cnn.md); on small things anywhere, where the max-pooled stem
# learns later than the CNN, twice that weight starts the capsules sooner (``capserve.train.stem``;
# docs/research/backbone.md). The built-in data sets keep the paper's recipe.
AUTO_BACKBONE_LOSS = {"builtin": 0.0, "own": 1.0, "own small things": 2.0}

# The grid the backbone classifier averages the backbone's map over (N×N), without --backbone-loss-grid, by the class
# capsule transforms the run has: where the labels follow where things lie (a transform per position), a 4×4 grid
# keeps where a stroke or a digit lies, which a global pool loses (a 2×2 one keeps less, an 8×8 one no more); where
# they do not (shared transforms), one global pool (docs/research/where-things-lie.md, its grid). No grid is finer
# than the backbone's map.
AUTO_BACKBONE_LOSS_GRID = {"per_position": 4, "shared": 1}

# A capsule network's label smoothing of a single-label cross-entropy, without --label-smoothing: on a user's images,
# 0.1 (Szegedy et al.'s) lifted the capsules' short runs on the sets of many classes and cost none of the others; the
# CNN baseline it moved by a seed's spread either way, so a CNN keeps whole labels (docs/research/class-capsules.md,
# label smoothing). The built-in data sets keep the paper's recipe. Multi-label targets, and the margin and spread
# losses of dynamic and EM routing, are never smoothed.
AUTO_LABEL_SMOOTHING = {"builtin": 0.0, "own": 0.1}


@dataclass
class TrainConfig:
    """All choices of a training run (saved with every checkpoint, restored by ``--resume``)."""

    model: str
    data: str
    out: str
    overrides: dict[str, Any] = field(default_factory=dict)
    epochs: int = 350
    batch_size: int | None = None  # None: AUTO_BATCH_SIZE for the data (resolved by the training set-up)
    lr: float | None = None  # None: the optimizer's own default (DEFAULT_LR)
    capsule_lr_scale: float | None = None  # the capsule layers' lr over the backbone's; None: AUTO_CAPSULE_LR_SCALE
    backbone_loss: float | None = None  # the backbone classifier's loss weight (0: none); None: AUTO_BACKBONE_LOSS
    backbone_loss_grid: int | None = None  # its N×N average pool; None: AUTO_BACKBONE_LOSS_GRID (resolved by the plan)
    label_smoothing: float | None = None  # single-label cross-entropy's ε; None: AUTO_LABEL_SMOOTHING (by the plan)
    momentum: float | None = None  # SGD only; None: 0.9
    optimizer: str = "auto"  # OPTIMIZERS; "auto" is resolved by the training set-up (``resolve_recipe``)
    weight_decay: float | None = None  # None: DEFAULT_WEIGHT_DECAY of the optimizer (resolved likewise)
    schedule: str | None = None  # SCHEDULES; None: AUTO_RECIPE's for the data (resolved likewise)
    amp: str = "auto"  # AMP_CHOICES; "auto": the fastest measured here (capserve.train.amp, resolved by the plan)
    channels_last: bool | None = None  # None: with --amp auto, measured; otherwise off
    time_budget: float | None = None
    max_steps: int | None = None
    grad_clip: float | None = None
    val_size: int | float | None = None  # None: DEFAULT_VAL_SIZE
    epoch_size: int | None = None
    seed: int = 0
    eval_batch_size: int = 500
    test: bool = True
    device: str = "auto"
    image_size: int | None = None  # own images: the model's input size (default: the config's)
    init: str | None = None  # a model folder to fine-tune from (shape-matching tensors are loaded)
    label_map: dict[str, str] = field(default_factory=dict)  # --init: its labels renamed in the data {OLD: NEW}
    label_separator: str | None = None  # a CSV's labels column: split on this (None: on spaces)
    name: str | None = None  # the model's name in served answers and exports (None: the --out folder's name)
    augment: str | None = None  # AUGMENTATIONS; None: the data's default (capserve.data.augment.default_augment)
    freeze: str | None = None  # FREEZE: "backbone" trains only the capsule layers (small data sets, with --init)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # nan compares False with every bound below, and would pass them all
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"--{f.name.replace('_', '-')} must be a finite number, got {value}")
        if self.model not in list_models():
            raise ValueError(f"unknown model {self.model!r}; choose one of: {', '.join(list_models())}")
        if self.schedule is not None and self.schedule not in SCHEDULES:
            raise ValueError(f"--schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"--optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.optimizer in ("adam", "adamw") and self.momentum is not None:
            raise ValueError(f"--momentum is SGD's; {self.optimizer} keeps its own moving averages (betas 0.9, 0.999)")
        if self.optimizer == "sgd" and self.momentum is None:
            self.momentum = 0.9
        if self.lr is None and self.optimizer != "auto":
            self.lr = DEFAULT_LR[self.optimizer]
        if self.augment is not None and self.augment not in AUGMENTATIONS:
            raise ValueError(f"--augment must be one of {AUGMENTATIONS}, got {self.augment!r}")
        if self.freeze is not None and self.freeze not in FREEZE:
            raise ValueError(f"--freeze must be one of {FREEZE}, got {self.freeze!r}")
        if self.freeze is not None and not self.init:
            raise ValueError(f"--freeze {self.freeze} keeps a trained backbone: give --init MODEL_DIR too")
        if self.amp not in AMP_CHOICES:
            raise ValueError(f"--amp must be one of {AMP_CHOICES}, got {self.amp!r}")
        for name in ("epochs", "batch_size", "eval_batch_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.weight_decay is not None and self.weight_decay < 0:
            raise ValueError(f"--weight-decay must be >= 0, got {self.weight_decay}")
        if self.lr is not None and self.lr <= 0:
            raise ValueError(f"--lr must be positive, got {self.lr}")
        if self.capsule_lr_scale is not None and self.capsule_lr_scale <= 0:
            raise ValueError(f"--capsule-lr-scale must be positive, got {self.capsule_lr_scale}")
        if self.backbone_loss is not None and not 0 <= self.backbone_loss < math.inf:
            raise ValueError(f"--backbone-loss must be a weight >= 0 (0: none), got {self.backbone_loss}")
        if self.backbone_loss_grid is not None and self.backbone_loss_grid < 1:
            raise ValueError(f"--backbone-loss-grid must be >= 1 (1: a global average), got {self.backbone_loss_grid}")
        if self.label_smoothing is not None and not 0 <= self.label_smoothing < 1:
            raise ValueError(f"--label-smoothing must be in [0, 1) (0: none), got {self.label_smoothing}")
        if self.label_map and not self.init:
            raise ValueError("--label-map renames labels of the --init model: give --init MODEL_DIR too")
        if self.name is not None and not self.name.strip():
            raise ValueError("--name must not be empty")
        if self.time_budget is not None and self.time_budget <= 0:
            raise ValueError(f"--time-budget must be positive seconds, got {self.time_budget}")


# ------------------------------------------------------------------------------------------------- schedule


def resolve_recipe(cfg: TrainConfig, own_data: bool, multi_label_capsules: bool = False) -> TrainConfig:
    """``cfg`` with every choice left to its default made: the optimizer ("auto": ``AUTO_RECIPE`` for the data), its
    lr, momentum and weight decay, the schedule and the batch size (``AUTO_BATCH_SIZE``, the optimizer's lr scaled
    with it; ``multi_label_capsules``: a capsule network on multi-label images). A run records the resolved values
    (``train_config.json``)."""
    kind = "own" if own_data else "builtin"
    batch = "own multi-label capsules" if own_data and multi_label_capsules else kind
    optimizer, schedule = AUTO_RECIPE[kind]
    if cfg.optimizer != "auto":
        optimizer = cfg.optimizer
    if cfg.momentum is not None and optimizer != "sgd":
        raise ValueError(f"--momentum is SGD's, and this run trains with {optimizer}: give --optimizer sgd too")
    return dataclasses.replace(
        cfg,
        optimizer=optimizer,
        lr=cfg.lr if cfg.lr is not None else DEFAULT_LR[optimizer] * AUTO_BATCH_SIZE[batch] / AUTO_BATCH_SIZE[kind],
        momentum=(cfg.momentum if cfg.momentum is not None else 0.9) if optimizer == "sgd" else None,
        weight_decay=cfg.weight_decay if cfg.weight_decay is not None else DEFAULT_WEIGHT_DECAY[optimizer],
        schedule=cfg.schedule or schedule,
        batch_size=cfg.batch_size or AUTO_BATCH_SIZE[batch],
        capsule_lr_scale=cfg.capsule_lr_scale or AUTO_CAPSULE_LR_SCALE[kind],
        backbone_loss=cfg.backbone_loss if cfg.backbone_loss is not None else AUTO_BACKBONE_LOSS[kind],
    )


def lr_factor(schedule: str, progress: float, epoch: int, epochs: int) -> float:
    """Multiplier of the base lr at ``progress`` in [0, 1] of the run (``epoch`` counts from 0)."""
    if schedule == "step":
        return 0.1 ** sum(epoch >= round(m * epochs) for m in MILESTONES)
    p = min(max(progress, 0.0), 1.0)
    if schedule == "cosine":
        return 0.5 * (1 + math.cos(math.pi * p))
    if p < WARMUP:  # onecycle
        return 1 / 25 + (1 - 1 / 25) * p / WARMUP
    return 0.5 * (1 + math.cos(math.pi * (p - WARMUP) / (1 - WARMUP)))


def read_resume_config(path: str | Path) -> TrainConfig:
    """The ``TrainConfig`` saved in a run folder (or its ``last/``), for ``--resume``."""
    path = Path(path)
    last = path if (path / "trainer.json").is_file() else path / "last"
    recover_directory(last)  # a run killed between the two renames of its last save
    if not (last / "trainer.json").is_file():
        raise FileNotFoundError(
            f"no checkpoint to resume in {path}: expected {path}/last/trainer.json "
            "(written by `capserve train --out DIR` after each epoch)"
        )
    recorded = json.loads((last / "trainer.json").read_text())["train_config"]
    recorded.setdefault("capsule_lr_scale", 1.0)  # a run recorded before the scale existed trained at one lr
    recorded.setdefault("backbone_loss", 0.0)  # ... and before the backbone loss, without one
    recorded.setdefault("backbone_loss_grid", 1)  # ... and before its grid, with a global average
    recorded.setdefault("label_smoothing", 0.0)  # ... and before label smoothing, without it
    return TrainConfig(**recorded)
