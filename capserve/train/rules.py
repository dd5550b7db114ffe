"""The rules a new run decides by, one function per choice: each takes the run's ``TrainConfig`` (and what it needs
of the data and model), returns it with the choice made and says why, in the words of the run's log. None of them
knows about ``--resume``: a resumed run decides nothing and reads its choices from its record
(``capserve.train.plan.resumed_plan``). ``capserve.train.plan.plan_run`` calls them in order; the rules the training
images make live beside their measurements (``class_layer``, ``stem``, ``few_images``).
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from capserve.configs import ModelConfig, get_config
from capserve.data.builtin import Data
from capserve.data.own import Manifest
from capserve.routing.attention import cross_entropy_loss
from capserve.routing.losses import training_loss
from capserve.train.config import AUTO_BACKBONE_LOSS_GRID, AUTO_LABEL_SMOOTHING, TrainConfig
from capserve.train.distributed import Dist

__all__ = [
    "OWN_BACKBONE",
    "SIZE_SAMPLE",
    "backbone_depth",
    "backbone_loss",
    "backbone_loss_grid",
    "class_norm",
    "fit_batch",
    "input_size",
    "label_smoothing",
    "recipe_reasons",
]


def class_norm(cfg: TrainConfig, manifest: Manifest | None) -> tuple[TrainConfig, str]:
    """``cfg`` with the class capsules' LayerNorm chosen (and why). A run from scratch on a user's images, of an
    attention capsule model with LayerNorm, normalises its class capsules together where one label answers
    (single-label: the classes compete for it, as the softmax over their logits does) and each alone where every
    label answers on its own (multi-label), recorded in ``overrides`` so that ``--resume`` rebuilds the same model
    (docs/research/class-capsules.md, one LayerNorm). Otherwise the config's: as given with ``--set
    class_norm=...``, ``--init``'s model's, and on the built-in data sets."""
    if "class_norm" in cfg.overrides:
        return cfg, "given"
    config = get_config(cfg.model, **cfg.overrides)
    attention = config.has_routing and config.routing_algorithm == "attention" and config.layer_norm
    if manifest is None or cfg.init or not attention:
        return cfg, "the model config's"
    if manifest.task == "multi_label":
        norm, why = "per_class", "multi-label: each label answers on its own, so each class capsule is normalised alone"
    else:
        norm, why = "joint", "single-label: the class capsules compete for one answer, under one LayerNorm"
    return dataclasses.replace(cfg, overrides={**cfg.overrides, "class_norm": norm}), why


# a user's capsule model on the conv backbone: its first two conv layers, then two residual blocks at the second's grid
OWN_BACKBONE = {"backbone_layers": 2, "backbone_blocks": 2}


def backbone_depth(cfg: TrainConfig, manifest: Manifest | None) -> tuple[TrainConfig, str]:
    """``cfg`` with the conv backbone's depth chosen (and why). A run from scratch on a user's images, of a capsule
    model on the conv backbone, puts two residual blocks after its first two conv layers in place of the third
    (``OWN_BACKBONE``): only the class layer routes, so the capsules add little that is not linear to what the backbone
    made of the image (docs/research/backbone.md, residual blocks). Recorded in ``overrides`` so
    that ``--resume`` rebuilds the same model. Otherwise the config's: as given with ``--set backbone_layers=N`` or
    ``backbone_blocks=N``, ``--init``'s model's, a CNN's, and on the built-in data sets."""
    if OWN_BACKBONE.keys() & cfg.overrides.keys():
        return cfg, "given"
    config = get_config(cfg.model, **cfg.overrides)
    if manifest is None or cfg.init or config.backbone != "conv" or not config.has_routing:
        return cfg, "the model config's"
    why = "your own images: residual blocks in place of a third conv layer"
    return dataclasses.replace(cfg, overrides={**cfg.overrides, **OWN_BACKBONE}), why


# training images whose sizes ``input_size`` reads (their headers only) to say how the input compares with them
SIZE_SAMPLE = 32


def input_size(cfg: TrainConfig, config: ModelConfig, manifest: Manifest | None) -> str:
    """Why the run decodes its images at ``config``'s input (C × size × size): given with ``--image-size``, the data
    set's (built-in data), or the model config's, with what that means for a user's images of another size (the
    most common size among the first ``SIZE_SAMPLE`` training images, from their headers)."""
    if manifest is None:
        return "the data set's"
    if cfg.image_size is not None:
        return f"given (--image-size {cfg.image_size})"
    from PIL import Image  # header reads only: nothing is decoded here

    sizes: Counter[tuple[int, int]] = Counter()
    for sample in manifest.splits["train"][:SIZE_SAMPLE]:
        try:
            with Image.open(sample.path) as image:
                sizes[image.size] += 1
        except OSError:  # an unreadable file is skipped with the others when the data is decoded
            continue
    why = f"the model config's {config.image_size}×{config.image_size}"
    if not sizes:
        return why
    (width, height), _ = sizes.most_common(1)[0]
    side = min(width, height)
    if side == config.image_size and width == height:
        return f"{why}, the size of your images"
    if side > config.image_size:
        return (
            f"{why}: your images are {width}×{height} and are resized down to it (--image-size {side} trains at "
            'their size, slower; docs/own-data.md, "Larger images")'
        )
    return f"{why}: your images are {width}×{height} and are resized up to it"


def recipe_reasons(given: TrainConfig, cfg: TrainConfig, own: bool, multi_label_capsules: bool) -> dict[str, str]:
    """Why the optimizer, schedule and batch size of ``cfg`` (``given``, resolved) are what they are."""
    data = "your own images" if own else "the built-in data sets"
    batch = "a capsule network on your own multi-label images" if multi_label_capsules else data
    return {
        "optimizer": "given" if given.optimizer != "auto" else f"the default for {data}",
        "schedule": "given" if given.schedule is not None else f"the default for {data}",
        "batch_size": "given" if given.batch_size is not None else f"the default for {batch}",
        "capsule_lr_scale": "given" if given.capsule_lr_scale is not None else f"the default for {data}",
        "backbone_loss": "given" if given.backbone_loss is not None else f"the default for {data}",
    }


def backbone_loss(cfg: TrainConfig, config: ModelConfig, given: TrainConfig) -> tuple[TrainConfig, str | None]:
    """``cfg`` without a backbone loss where it cannot work (and why): a CNN (its classifier already reads its
    backbone), or a frozen backbone. Given for either, it is a mistake the user hears about."""
    if not cfg.backbone_loss:
        return cfg, None
    if not config.has_routing:
        why = f"{config.name} is a CNN: its own classifier reads its backbone"
    elif cfg.freeze == "backbone":
        why = "--freeze backbone: the backbone does not train"
    else:
        return cfg, None
    if given.backbone_loss is not None:
        raise ValueError(f"--backbone-loss trains a capsule network's backbone, and {why}: drop --backbone-loss")
    return dataclasses.replace(cfg, backbone_loss=0.0), why


def label_smoothing(cfg: TrainConfig, config: ModelConfig, own: bool) -> tuple[TrainConfig, str]:
    """``cfg`` with the label smoothing resolved (and why): as given, or a capsule network's ``AUTO_LABEL_SMOOTHING``
    for the data (a CNN: none); none where the targets are not one label's or the loss is not a cross-entropy. Given
    for either, it is a mistake the user hears about."""
    if config.task == "multi_label":
        why_not = "multi-label targets say of each label on its own whether it is there"
    elif training_loss(config) is not cross_entropy_loss:
        why_not = f"{config.routing_algorithm} routing trains with its own paper's loss"
    else:
        why_not = None
    if why_not is not None:
        if cfg.label_smoothing:
            raise ValueError(f"--label-smoothing softens one label's cross-entropy, and {why_not}: drop it")
        return dataclasses.replace(cfg, label_smoothing=0.0), why_not
    if cfg.label_smoothing is not None:
        return cfg, "given"
    if not config.has_routing:
        return dataclasses.replace(
            cfg, label_smoothing=0.0
        ), f"{config.name} is a CNN: smoothing helped the capsules on the battery, not it"
    data = "your own images" if own else "the built-in data sets"
    return dataclasses.replace(cfg, label_smoothing=AUTO_LABEL_SMOOTHING["own" if own else "builtin"]), (
        f"the default for {data}"
    )


def backbone_loss_grid(cfg: TrainConfig, config: ModelConfig) -> tuple[TrainConfig, str]:
    """``cfg`` with the backbone classifier's pooling grid resolved (and why): as given, or by the run's class capsule
    transforms (``AUTO_BACKBONE_LOSS_GRID``); 1 where there is no backbone loss. Given to a run without one, it is a
    mistake the user hears about."""
    if not cfg.backbone_loss:
        if cfg.backbone_loss_grid is not None:
            raise ValueError("--backbone-loss-grid pools the backbone loss's classifier, and this run has none")
        return dataclasses.replace(cfg, backbone_loss_grid=1), "no backbone loss"
    if cfg.backbone_loss_grid is not None:
        if cfg.backbone_loss_grid > config.feature_size:
            raise ValueError(
                f"--backbone-loss-grid {cfg.backbone_loss_grid} is finer than the backbone's "
                f"{config.feature_size}×{config.feature_size} map: give at most {config.feature_size}"
            )
        return cfg, "given"
    grid = min(AUTO_BACKBONE_LOSS_GRID[config.class_weights], config.feature_size)
    where = "per position" if config.class_weights == "per_position" else "shared"
    if config.class_weights == "per_position" and config.class_grid == 1:
        where += " in one cell, one per type wherever it lies"
    return dataclasses.replace(cfg, backbone_loss_grid=grid), f"the class layer's transforms are {where}"


def fit_batch(cfg: TrainConfig, data: Data, given: bool, d: Dist) -> tuple[TrainConfig, str | None]:
    """``cfg`` with a batch the data can fill (and why, when it changed): a default batch never refuses a small data
    set, it takes one batch of all its images (a multiple of the processes); a given one does."""
    if data.epoch_size < cfg.batch_size and not given and data.epoch_size >= d.world:
        batch = data.epoch_size // d.world * d.world
        reason = f"one batch of all {data.epoch_size} training images (fewer than the default {cfg.batch_size})"
        return dataclasses.replace(cfg, batch_size=batch), reason
    if data.epoch_size < cfg.batch_size:
        raise ValueError(f"--batch-size {cfg.batch_size} exceeds the {data.epoch_size} training images per epoch")
    return cfg, None
