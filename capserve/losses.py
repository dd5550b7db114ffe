"""Training losses, one per routing algorithm, each as its own paper trains it.

Every model returns logits (B, C) whatever its routing, so that serving, evaluation and export never ask which
routing a model uses; a routing whose paper scores capsules by length or activation in (0, 1) returns that score
as a logit (sigmoid(logit) = score), and its loss reads the score back with ``torch.sigmoid``.

- ``attention`` (inverted dot-product attention, Tsai et al. 2020): cross-entropy for single-label tasks, binary
  cross-entropy per class for multi-label ones, on the linear read-out of the class capsules.
- ``dynamic`` (Sabour et al. 2017): margin loss on the class capsules' lengths |v_k| = sigmoid(logit_k),
  Σ_k T_k max(0, m⁺ − |v_k|)² + λ (1 − T_k) max(0, |v_k| − m⁻)² with m⁺ = 0.9, m⁻ = 0.1, λ = 0.5, averaged over
  the batch. T_k is 1 for the image's class; for multi-label images, for each class present (the original's own
  use on two overlapping digits). No reconstruction term: the seed paper's CapsNet* comparison has no decoder.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from capserve.configs import ModelConfig

# (logits (B, C), targets: (B,) class indices or (B, C) multi-hot, multi_label, progress through training in [0, 1])
Loss = Callable[[Tensor, Tensor, bool, float], Tensor]


def cross_entropy_loss(logits: Tensor, targets: Tensor, multi_label: bool, progress: float = 1.0) -> Tensor:
    """Softmax cross-entropy, or per-class binary cross-entropy for multi-label targets."""
    if multi_label:
        return F.binary_cross_entropy_with_logits(logits, targets)
    return F.cross_entropy(logits, targets)


# Sabour et al. (2017), section 3: a present class's capsule should be longer than m⁺, an absent one's shorter than
# m⁻; absent classes weigh λ, so that early training does not shrink every capsule
MARGIN_PRESENT, MARGIN_ABSENT, ABSENT_WEIGHT = 0.9, 0.1, 0.5


def margin_loss(logits: Tensor, targets: Tensor, multi_label: bool, progress: float = 1.0) -> Tensor:
    """Margin loss on capsule lengths sigmoid(logits) (B, C), summed over classes, averaged over the batch."""
    lengths = torch.sigmoid(logits)  # (B, C): |v_k|
    present = targets.to(lengths.dtype) if multi_label else F.one_hot(targets, logits.shape[1]).to(lengths.dtype)
    per_class = present * F.relu(MARGIN_PRESENT - lengths) ** 2  # (B, C)
    per_class = per_class + ABSENT_WEIGHT * (1 - present) * F.relu(lengths - MARGIN_ABSENT) ** 2
    return per_class.sum(dim=1).mean()


LOSSES: dict[str, Loss] = {"attention": cross_entropy_loss, "dynamic": margin_loss}


def training_loss(config: ModelConfig) -> Loss:
    """The loss that ``config``'s routing algorithm is trained with (a baseline CNN: cross-entropy)."""
    if not config.has_routing:
        return cross_entropy_loss
    return LOSSES[config.routing_algorithm]
