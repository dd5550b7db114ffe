"""Training losses, one per routing algorithm, each as its own paper trains it (the table: ``ROUTINGS``).

Every model returns logits (B, C) whatever its routing, so that serving, evaluation and export never ask which
routing a model uses; a routing whose paper scores capsules by length or activation in (0, 1) returns that score
as a logit (sigmoid(logit) = score), and its loss reads the score back with ``torch.sigmoid``.

- ``attention`` (inverted dot-product attention, Tsai et al. 2020): cross-entropy for single-label tasks (against
  targets smoothed by ``--label-smoothing``, a user's images' default), binary cross-entropy per class for
  multi-label ones, on the linear read-out of the class capsules.
- ``dynamic`` (Sabour et al. 2017): margin loss on the class capsules' lengths |v_k| = sigmoid(logit_k),
  Σ_k T_k max(0, m⁺ − |v_k|)² + λ (1 − T_k) max(0, |v_k| − m⁻)² with m⁺ = 0.9, m⁻ = 0.1, λ = 0.5, averaged over
  the batch. T_k is 1 for the image's class; for multi-label images, for each class present (the original's own
  use on two overlapping digits). No reconstruction term: the seed paper's CapsNet* comparison has no decoder.
- ``em`` (Hinton et al. 2018): the spread loss on the class activations a = sigmoid(logit),
  L = Σ_{i≠t} max(0, m − (a_t − a_i))², with the margin m rising linearly from 0.2 to 0.9 over training, as the
  paper does. Multi-label targets: see ``spread_loss``.
"""

from __future__ import annotations

import functools

from capserve.configs import ModelConfig
from capserve.routing.attention import cross_entropy_loss
from capserve.routing.registry import ROUTINGS, Loss


def training_loss(config: ModelConfig, label_smoothing: float = 0.0) -> Loss:
    """The loss that ``config``'s routing algorithm is trained with (a baseline CNN: cross-entropy), its single-label
    targets smoothed by ``label_smoothing`` where that loss is a cross-entropy (a margin or spread loss has none)."""
    loss = ROUTINGS[config.routing_algorithm].loss if config.has_routing else cross_entropy_loss
    if not label_smoothing:
        return loss
    if loss is not cross_entropy_loss:
        raise ValueError(
            f"label smoothing softens a cross-entropy's targets, and {config.routing_algorithm} routing trains with "
            "its own paper's loss: drop --label-smoothing"
        )
    return functools.partial(cross_entropy_loss, label_smoothing=label_smoothing)
