"""The recipe for many classes from few pictures: a capsule network that learns more than ``MANY_CLASSES`` classes of a
user's single-label images from fewer than ``FEW_IMAGES_A_CLASS`` pictures each trains with a stronger weight decay,
stronger label smoothing and a deeper backbone (``FEW_IMAGES``).

There the class layer holds one set of transforms per class, each learnt from a handful of pictures, and the capsule
runs fit their training images while their validation score still climbs: docs/own-data.md, "Many classes from few
images", has the measurements.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from capserve.configs import get_config
from capserve.data.own import Manifest
from capserve.train.config import TrainConfig

__all__ = ["FEW_IMAGES", "FEW_IMAGES_A_CLASS", "MANY_CLASSES", "few_images", "images_a_class"]

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
    cfg: TrainConfig, given: TrainConfig, manifest: Manifest | None, resume: str | Path | None
) -> tuple[TrainConfig, dict[str, str]]:
    """``cfg`` with ``FEW_IMAGES`` where a new run from scratch of an attention capsule network learns more than
    ``MANY_CLASSES`` labels of a user's single-label images from fewer than ``FEW_IMAGES_A_CLASS`` training images a
    class, and why, under ``few_images`` and the key of each choice it made (``weight_decay``, ``label_smoothing``,
    ``backbone_depth``). What the user gave stays: ``--weight-decay``, ``--label-smoothing``, ``--set
    backbone_blocks=N`` (or ``backbone_layers``); the weight decay is AdamW's, the blocks the conv backbone's."""
    if manifest is None or resume is not None or cfg.init or manifest.task != "single_label":
        return cfg, {}
    config = get_config(cfg.model, **cfg.overrides)
    classes, per_class = len(manifest.labels), images_a_class(manifest)
    if not config.has_routing or config.routing_algorithm != "attention":
        return cfg, {}
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
