"""The class capsule layer a user's images choose (``capserve.data.placement`` measures them): its transforms, one
per position, per cell or per type, and on multi-label images whose labels follow where things lie its poses.

docs/research/where-things-lie.md (a transform per position, per cell or shared) and docs/research/multi-label.md
("Which poses and class transforms where several labels follow where things lie?") have the measurements.
"""

from __future__ import annotations

from typing import Literal

from capserve.configs import ModelConfig
from capserve.data.placement import Placement
from capserve.train.config import TrainConfig

__all__ = ["OWN_ALIGNED_MULTI_LABEL", "OWN_CLASS_GRID", "choose_class_layer", "chooses_class_weights"]

# a user's class transforms per position, shared within each cell of this grid over the class layer's children
OWN_CLASS_GRID = 2
# where several labels answer and they follow where things lie: vector poses, and one class transform per type
# wherever it lies; the backbone classifier's grid still follows the measurement
OWN_ALIGNED_MULTI_LABEL = {"pose": "vector", "class_grid": 1}


def chooses_class_weights(cfg: TrainConfig, config: ModelConfig) -> bool:
    """Whether a run picks its class capsule transforms from its data: a run from scratch on a user's images, of an
    attention capsule model whose class layer reads a grid, without ``--set class_weights=...`` or
    ``class_grid=...``."""
    return (
        not cfg.init
        and not {"class_weights", "class_grid"} & cfg.overrides.keys()
        and config.has_routing
        and config.routing_algorithm == "attention"
        and (not config.capsules or config.capsules[-1].kind == "conv")
    )


def choose_class_layer(
    placement: Placement, task: Literal["single_label", "multi_label"], side: int, given: dict
) -> tuple[dict[str, str | int], dict[str, str]]:
    """The overrides that the training images' ``placement`` chooses for a class layer reading a ``side`` × ``side``
    grid, and why (under ``class_weights``, and ``pose`` where it chose one). Transforms per position are shared
    within the cells of an ``OWN_CLASS_GRID`` grid; on multi-label images ``OWN_ALIGNED_MULTI_LABEL`` instead, unless
    the ``given`` overrides name a pose."""
    chosen: dict[str, str | int] = {"class_weights": placement.class_weights}
    reasons = {"class_weights": placement.reason()}
    if placement.class_weights == "per_position" and task == "multi_label" and "pose" not in given:
        chosen.update(OWN_ALIGNED_MULTI_LABEL)
        reasons["class_weights"] += "; on multi-label images one per type wherever it lies, with vector poses"
        reasons["pose"] = (
            "several labels answer and they follow where things lie: vector poses, with one class transform per type "
            "wherever it lies (--set pose='\"matrix\"' keeps matrices)"
        )
    elif placement.class_weights == "per_position":
        chosen["class_grid"] = grid = min(OWN_CLASS_GRID, side)
        reasons["class_weights"] += (
            f"; one per type in each cell of a {grid}×{grid} grid over the class layer's {side}×{side} children"
        )
    return chosen, reasons
