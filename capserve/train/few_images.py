"""The recipes for few pictures a class. A capsule network that learns more than ``MANY_CLASSES`` classes of a user's
single-label images from fewer than ``FEW_IMAGES_A_CLASS`` pictures each trains with a stronger weight decay,
stronger label smoothing and a deeper backbone (``FEW_IMAGES``). One that learns from fewer than
``FEW_IMAGES_A_CLASS`` pictures a class of things in their place (``capserve.data.placement``: photographs framed on
their subject) whose labels survive a mirror (``capserve.data.mirror``) shifts and mirrors them (``crop-flip``),
whatever the class count.

There the class layer holds one set of transforms per class, each learnt from a handful of pictures, and the capsule
runs fit their training images while their validation score still climbs; a shift and a mirror make new views of a
framed subject, where things that lie anywhere already show every place, and on a few thousand pictures they only
slow a short run down. docs/research/class-capsules.md ("What helps many classes from few images?") and
docs/research/augmentation.md ("When do few pictures a class gain from crop-flip?") have the measurements.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from capserve.configs import ModelConfig, get_config
from capserve.data.mirror import measure_mirror
from capserve.data.own import Manifest
from capserve.data.placement import Placement
from capserve.data.splits import Split
from capserve.train.config import TrainConfig

__all__ = [
    "FEW_IMAGES",
    "FEW_IMAGES_A_CLASS",
    "MANY_CLASSES",
    "few_images",
    "images_a_class",
    "recipe",
    "shift_and_mirror",
]

# more labels than this, each with fewer training images than FEW_IMAGES_A_CLASS (after validation is carved)
MANY_CLASSES = 10
FEW_IMAGES_A_CLASS = 64
# AdamW's decoupled weight decay, single-label smoothing, and the conv backbone: its three conv layers, then four
# residual blocks
FEW_IMAGES = {"weight_decay": 0.5, "label_smoothing": 0.2, "backbone_layers": 3, "backbone_blocks": 4}


def images_a_class(manifest: Manifest) -> float:
    """The training images of the data per label (its labels are the training split's)."""
    return len(manifest.splits["train"]) / max(len(manifest.labels), 1)


def few_images(
    cfg: TrainConfig, given: TrainConfig, manifest: Manifest, train: Split, placement: Callable[[], Placement]
) -> tuple[TrainConfig, dict[str, str]]:
    """``cfg`` with both recipes for few pictures a class where they apply to a run from scratch of an attention
    capsule network on a user's single-label images (``recipe``, then ``shift_and_mirror``), and why, under the key
    of each choice. ``placement`` measures where things lie in ``train`` (once, shared with the class layer's
    choice)."""
    config = get_config(cfg.model, **cfg.overrides)
    if cfg.init or manifest.task != "single_label" or not config.has_routing or config.routing_algorithm != "attention":
        return cfg, {}
    cfg, reasons = recipe(cfg, given, manifest, config)
    cfg, augment = shift_and_mirror(cfg, manifest, train, placement)
    return cfg, {**reasons, **augment}


def recipe(
    cfg: TrainConfig, given: TrainConfig, manifest: Manifest, config: ModelConfig
) -> tuple[TrainConfig, dict[str, str]]:
    """``cfg`` with ``FEW_IMAGES`` where the run learns more than ``MANY_CLASSES`` labels from fewer than
    ``FEW_IMAGES_A_CLASS`` training images a class, and why, under ``few_images`` and the key of each choice it made
    (``weight_decay``, ``label_smoothing``, ``backbone_depth``). What the user gave stays: ``--weight-decay``,
    ``--label-smoothing``, ``--set backbone_blocks=N`` (or ``backbone_layers``); the weight decay is AdamW's, the
    blocks the conv backbone's."""
    classes, per_class = len(manifest.labels), images_a_class(manifest)
    if classes <= MANY_CLASSES or per_class >= FEW_IMAGES_A_CLASS:
        return cfg, {}
    why = f"{classes} classes from {per_class:.0f} training images a class"
    changes: dict = {}
    reasons = {"few_images": why}
    if given.weight_decay is None and cfg.optimizer == "adamw":
        changes["weight_decay"] = FEW_IMAGES["weight_decay"]
        reasons["weight_decay"] = why
    if given.label_smoothing is None:
        changes["label_smoothing"] = FEW_IMAGES["label_smoothing"]
        reasons["label_smoothing"] = why
    if config.backbone == "conv" and not {"backbone_layers", "backbone_blocks"} & given.overrides.keys():
        depth = {key: FEW_IMAGES[key] for key in ("backbone_layers", "backbone_blocks")}
        changes["overrides"] = {**cfg.overrides, **depth}
        reasons["backbone_depth"] = f"{why}: four residual blocks after the three conv layers"
    return dataclasses.replace(cfg, **changes), reasons


def shift_and_mirror(
    cfg: TrainConfig, manifest: Manifest, train: Split, placement: Callable[[], Placement]
) -> tuple[TrainConfig, dict[str, str]]:
    """``cfg`` with ``--augment crop-flip`` where the run, without ``--augment``, learns from fewer than
    ``FEW_IMAGES_A_CLASS`` training images a class whose labels follow where things lie and survive a mirror (both
    measured on ``train``), and why (under ``augment``); with ``none``, and why, where things lie anywhere or a mirror
    may change the labels."""
    per_class = images_a_class(manifest)
    if cfg.augment is not None or per_class >= FEW_IMAGES_A_CLASS:
        return cfg, {}
    where = placement()
    if not where.aligned:
        why = f"{per_class:.0f} training images a class, but {where.reason()}: a shift adds no new view of them"
        return dataclasses.replace(cfg, augment="none"), {"augment": why}
    mirror = measure_mirror(train.images, train.targets, cfg.seed)
    if not mirror.survives:
        why = f"{per_class:.0f} training images a class, but {mirror.reason()}: a mirrored picture may be another's"
        return dataclasses.replace(cfg, augment="none"), {"augment": why}
    why = (
        f"{per_class:.0f} training images a class, the labels follow where things lie, and {mirror.reason()}: "
        "shifted and mirrored, they make more"
    )
    return dataclasses.replace(cfg, augment="crop-flip"), {"augment": why}
