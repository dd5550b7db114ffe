"""A training-only classifier on a capsule network's backbone, whose loss joins the capsules' (``--backbone-loss W``).

The capsules' loss reaches the backbone only through the primary capsules, their LayerNorm and every routing step;
on a user's few thousand images the backbone then learns less in a short run than a CNN's does, and the capsules on
top of it read weaker features (docs/research/capsules-beside-the-cnn.md). A linear classifier on the backbone's
pooled features gives it a direct signal from the first step, the way auxiliary classifiers do in deep supervision.
Its pool is a grid (``--backbone-loss-grid N``, N×N cells): a global average where the labels do not follow where
things lie, 4×4 where they do, so that it keeps where a stroke or a digit lies. The classifier lives beside the
model, never in it: ``best/`` and every export hold the capsule network alone, and the served answers are the
capsules'. ``last/`` keeps its weights, so ``--resume`` continues it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn import functional as F

from capserve.model.capsnet import CapsNet
from capserve.routing.attention import cross_entropy_loss

__all__ = ["BackboneClassifier", "backbone_classifier"]


class BackboneClassifier(nn.Module):
    """Average pooling to a ``grid`` × ``grid`` map and a linear layer over the backbone's output (B, channels, h, w)
    → (B, C) logits, with the weighted loss that joins the capsules' (``loss``).

    It reads the backbone's output through a forward hook while the backbone is in training mode, so that the
    model's own forward (plain or wrapped in DDP) runs unchanged.
    """

    def __init__(self, model: CapsNet, weight: float, grid: int = 1):
        super().__init__()
        if weight <= 0:
            raise ValueError(f"the backbone loss weight must be positive, got {weight}")
        c = model.config
        self.weight, self.grid = weight, grid
        self.linear = nn.Linear(c.backbone_channels * grid * grid, c.num_classes)
        self._features: Tensor | None = None
        model.backbone.register_forward_hook(self._keep)

    def _keep(self, module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> None:
        self._features = output if module.training else None

    def loss(self, targets: Tensor, multi_label: bool, label_smoothing: float = 0.0) -> Tensor:
        """``weight`` × the cross-entropy (multi-label: binary, per class; single-label: with the capsules' label
        smoothing) of the last training forward's backbone features, read once."""
        features, self._features = self._features, None
        if features is None:
            raise RuntimeError("no backbone features to classify: call the model in training mode first")
        pooled = F.adaptive_avg_pool2d(features.float(), self.grid).flatten(1)  # (B, channels·grid²)
        logits = self.linear(pooled)  # (B, C)
        return self.weight * cross_entropy_loss(logits, targets, multi_label, label_smoothing=label_smoothing)

    def average_gradients(self) -> None:
        """In a DDP run, the mean of every process's gradients (DDP averages the model's, not this module's)."""
        world = dist.get_world_size()
        for p in self.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= world


def backbone_classifier(model: torch.nn.Module, weight: float, grid: int = 1) -> BackboneClassifier | None:
    """The run's backbone classifier, or None: a weight of 0, or a model without capsules (a CNN is its own)."""
    if weight == 0 or not isinstance(model, CapsNet):
        return None
    return BackboneClassifier(model, weight, grid)
