"""A run's optimizer, from its resolved recipe (``capserve.train.config.resolve_recipe``)."""

from __future__ import annotations

import torch

from capserve.model.factory import Model
from capserve.train.backbone_loss import BackboneClassifier
from capserve.train.config import TrainConfig

__all__ = ["make_optimizer"]


def make_optimizer(
    model: Model, cfg: TrainConfig, backbone_head: BackboneClassifier | None = None
) -> torch.optim.Optimizer:
    """The run's optimizer (``cfg`` resolved by ``resolve_recipe``): SGD with momentum (the authors'), Adam (both with
    L2 weight decay) or AdamW (decoupled weight decay, none on biases and normalisation gains: shrinking those only
    costs fit), over the parameters that train (``--freeze backbone`` leaves the backbone's out). A capsule network's
    parameters outside the backbone form their own groups, whose ``lr_scale`` (``cfg.capsule_lr_scale``) multiplies
    the schedule's lr at every step (``train_step``). A backbone classifier (``--backbone-loss``) steps with the
    backbone, its parameters after the model's."""
    trained = [p for p in model.parameters() if p.requires_grad]
    backbone = {id(p) for p in model.backbone.parameters()}
    if backbone_head is not None:
        trained += list(backbone_head.parameters())
        backbone |= {id(p) for p in backbone_head.parameters()}
    scale = cfg.capsule_lr_scale if model.config.has_routing else 1.0
    parts = [(trained, 1.0)]  # at one lr, the groups (and a resumed optimizer's state) of a run recorded before scales
    if scale != 1.0:
        parts = [
            ([p for p in trained if id(p) in backbone], 1.0),
            ([p for p in trained if id(p) not in backbone], scale),
        ]
    groups = []
    for params, lr_scale in parts:
        if cfg.optimizer == "adamw":
            groups += [
                {"params": [p for p in params if p.ndim > 1], "weight_decay": cfg.weight_decay, "lr_scale": lr_scale},
                {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0, "lr_scale": lr_scale},
            ]
        else:
            groups.append({"params": params, "lr_scale": lr_scale})
    groups = [g for g in groups if g["params"]]
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(groups, lr=cfg.lr, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    raise ValueError(f"optimizer {cfg.optimizer!r} is not resolved: call resolve_recipe first")
