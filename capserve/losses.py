"""Training losses, one per routing algorithm, each as its own paper trains it.

Every model returns logits (B, C) whatever its routing, so that serving, evaluation and export never ask which
routing a model uses; a routing whose paper scores capsules by length or activation in (0, 1) returns that score
as a logit (sigmoid(logit) = score), and its loss reads the score back with ``torch.sigmoid``.

- ``attention`` (inverted dot-product attention, Tsai et al. 2020): cross-entropy for single-label tasks, binary
  cross-entropy per class for multi-label ones, on the linear read-out of the class capsules.
"""

from __future__ import annotations

from collections.abc import Callable

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


LOSSES: dict[str, Loss] = {"attention": cross_entropy_loss}


def training_loss(config: ModelConfig) -> Loss:
    """The loss that ``config``'s routing algorithm is trained with (a baseline CNN: cross-entropy)."""
    if not config.has_routing:
        return cross_entropy_loss
    return LOSSES[config.routing_algorithm]
