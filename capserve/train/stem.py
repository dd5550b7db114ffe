"""The conv backbone's stem a run on a user's images chooses: a max-pool after its first layer that keeps the capsule
grid of a 32-pixel input for larger images (``stem_pool``), and one in place of its strided second layer for small
things anywhere, with the heavier backbone loss that goes with it (``pooled_stem``).
docs/research/backbone.md has the measurements (the max-pool, larger inputs); docs/own-data.md ("Larger images")
is the guide.
"""

from __future__ import annotations

import dataclasses

from capserve.configs import ModelConfig
from capserve.data.placement import SMALL_SPREAD, Placement
from capserve.train.config import AUTO_BACKBONE_LOSS, TrainConfig

__all__ = ["pooled_stem", "stem_pool"]


def stem_pool(cfg: TrainConfig, config: ModelConfig) -> int:
    """The conv backbone's stem pooling for ``--image-size N`` above the config's size: N // size, so that the capsule
    layers see the grid their routing was measured at, and cost what they cost there (docs/own-data.md, "Larger
    images"); 1 for any other run, and as given with ``--set stem_pool=K`` (``--init``: its model's, when not 1)."""
    if "stem_pool" in cfg.overrides or config.backbone != "conv" or cfg.image_size is None:
        return config.stem_pool
    return max(cfg.image_size // config.image_size, 1)


def pooled_stem(
    placement: Placement, cfg: TrainConfig, given: TrainConfig, config: ModelConfig
) -> tuple[TrainConfig, dict[str, str]]:
    """``cfg`` with a max-pool in place of the conv backbone's strided layer, at the same capsule grid, for a capsule
    network on single-label images of small things anywhere (``Placement.small_things``), and why (under
    ``stem_pool``): a small thing shifted by a pixel meets the stride's sampling anew, and a max-pool reports its
    strongest part wherever it fell (docs/research/backbone.md, the max-pool). Such a run's backbone
    loss weighs twice that of other runs on a user's images, ``AUTO_BACKBONE_LOSS["own small things"]``, which starts
    the capsules sooner there (why under ``backbone_loss``; as given with ``--backbone-loss``). Nothing for any other
    run, nor with ``--set stem_pool=K`` or ``backbone_stride=K`` given; recorded in ``overrides`` so that
    ``--resume`` rebuilds the same model. The pool takes over the stride on top of any ``--image-size`` pooling."""
    if {"stem_pool", "backbone_stride"} & given.overrides.keys() or config.backbone != "conv":
        return cfg, {}
    if config.backbone_stride == 1 or config.task != "single_label" or not placement.small_things:
        return cfg, {}
    pool = config.stem_pool * config.backbone_stride
    reasons = {
        "stem_pool": (
            f"the labels are small things anywhere (their edges fill {placement.spread:.2f} of the picture; under "
            f"{SMALL_SPREAD:g} counts as small): a max-pool by {pool} after the first layer in place of the strided "
            "second, at the same capsule grid (--set backbone_stride=2 keeps the stride)"
        )
    }
    cfg = dataclasses.replace(cfg, overrides={**cfg.overrides, "stem_pool": pool, "backbone_stride": 1})
    if given.backbone_loss is None:
        cfg = dataclasses.replace(cfg, backbone_loss=AUTO_BACKBONE_LOSS["own small things"])
        reasons["backbone_loss"] = (
            "the default for a capsule network on small things anywhere, whose stem is max-pooled"
        )
    return cfg, reasons
