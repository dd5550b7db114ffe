"""``TrainConfig``: every choice of a training run, as data (written to ``train_config.json``), and the
learning-rate schedules."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from capserve.configs import list_models
from capserve.data.augment import AUGMENTATIONS

SCHEDULES = ("step", "cosine", "onecycle")


AMP = {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}


OPTIMIZERS = ("sgd", "adam")


FREEZE = ("backbone",)  # parts of the model that --freeze keeps at their --init values


DEFAULT_LR = {"sgd": 0.1, "adam": 1e-3}


WARMUP = 0.15  # one-cycle warm-up fraction


MILESTONES = (150 / 350, 250 / 350)  # the authors' step epochs as fractions of the run


DEFAULT_VAL_SIZE = {"builtin": 5000, "own": 0.1}  # images for CIFAR/MNIST; a fraction of a user's training images


# L2 weight decay without --weight-decay: the authors' 5e-4 for the built-in data sets and for fine-tuning (--init
# starts from trained weights), 40 times more for a user's images trained from scratch: a few thousand images, often
# without augmentation (capserve.data.augment), were memorised at 5e-4 (train exact match 99.96 %, validation loss
# rising from epoch 14). Measured with `capserve train` (benchmarks/bench_own_data.py, docs/own-data.md): two-digit
# pairs 65.0 / 75.2 / 84.4 % test exact match at 5e-4 / 5e-3 / 2e-2; MNIST digits 95.3 / - / 98.0 % top-1.
DEFAULT_WEIGHT_DECAY = {"builtin": 5e-4, "own": 2e-2, "init": 5e-4}


@dataclass
class TrainConfig:
    """All choices of a training run (saved with every checkpoint, restored by ``--resume``)."""

    model: str
    data: str
    out: str
    overrides: dict[str, Any] = field(default_factory=dict)
    epochs: int = 350
    batch_size: int = 128
    lr: float | None = None  # None: the optimizer's own default (DEFAULT_LR)
    momentum: float | None = None  # SGD only; None: 0.9
    optimizer: str = "sgd"
    weight_decay: float | None = None  # None: DEFAULT_WEIGHT_DECAY for the data (resolved by the training set-up)
    schedule: str = "step"
    amp: str = "off"
    channels_last: bool = False
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
        if self.model not in list_models():
            raise ValueError(f"unknown model {self.model!r}; choose one of: {', '.join(list_models())}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"--schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"--optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.optimizer == "adam" and self.momentum is not None:
            raise ValueError("--momentum is SGD's; Adam keeps its own moving averages (betas 0.9, 0.999)")
        if self.optimizer == "sgd" and self.momentum is None:
            self.momentum = 0.9
        if self.lr is None:
            self.lr = DEFAULT_LR[self.optimizer]
        if self.augment is not None and self.augment not in AUGMENTATIONS:
            raise ValueError(f"--augment must be one of {AUGMENTATIONS}, got {self.augment!r}")
        if self.freeze is not None and self.freeze not in FREEZE:
            raise ValueError(f"--freeze must be one of {FREEZE}, got {self.freeze!r}")
        if self.freeze is not None and not self.init:
            raise ValueError(f"--freeze {self.freeze} keeps a trained backbone: give --init MODEL_DIR too")
        if self.amp not in AMP:
            raise ValueError(f"--amp must be one of {tuple(AMP)}, got {self.amp!r}")
        for name in ("epochs", "batch_size", "eval_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.weight_decay is not None and self.weight_decay < 0:
            raise ValueError(f"--weight-decay must be >= 0, got {self.weight_decay}")
        if self.lr <= 0:
            raise ValueError(f"--lr must be positive, got {self.lr}")
        if self.label_map and not self.init:
            raise ValueError("--label-map renames labels of the --init model: give --init MODEL_DIR too")
        if self.name is not None and not self.name.strip():
            raise ValueError("--name must not be empty")
        if self.time_budget is not None and self.time_budget <= 0:
            raise ValueError(f"--time-budget must be positive seconds, got {self.time_budget}")


# ------------------------------------------------------------------------------------------------- schedule


def default_weight_decay(own_data: bool, init: str | None) -> float:
    """The weight decay a run uses without ``--weight-decay`` (see ``DEFAULT_WEIGHT_DECAY``)."""
    return DEFAULT_WEIGHT_DECAY["init" if init else "own" if own_data else "builtin"]


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
    if not (last / "trainer.json").is_file():
        raise FileNotFoundError(f"no checkpoint to resume in {path}: expected {path}/last/trainer.json "
                                "(written by `capserve train --out DIR` after each epoch)")  # fmt: skip
    return TrainConfig(**json.loads((last / "trainer.json").read_text())["train_config"])
