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
- ``em`` (Hinton et al. 2018): the spread loss on the class activations a = sigmoid(logit),
  L = Σ_{i≠t} max(0, m − (a_t − a_i))², with the margin m rising linearly from 0.2 to 0.9 over training, as the
  paper does. Multi-label targets: see ``spread_loss``.
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


SPREAD_MARGIN = (0.2, 0.9)  # the paper's margin at the start and at the end of training


def spread_margin(progress: float) -> float:
    """The spread loss margin after ``progress`` ∈ [0, 1] of training: linear from 0.2 to 0.9."""
    start, end = SPREAD_MARGIN
    return start + (end - start) * min(max(progress, 0.0), 1.0)


def spread_loss(logits: Tensor, targets: Tensor, multi_label: bool, progress: float = 1.0) -> Tensor:
    """The spread loss of matrix capsules (Hinton et al. 2018), mean over the batch.

    Single-label: L = Σ_{i≠t} max(0, m − (a_t − a_i))², a = sigmoid(logits), t the target class.
    Multi-label (the paper has none; this generalisation reduces to the paper's loss for one present class, apart from
    the threshold terms): every present class p is spread from every absent class q, Σ_{p,q} max(0, m − (a_p − a_q))²,
    and, because a multi-label decision is a > 0.5 (logit > 0; see ``ModelConfig.thresholds``), from that threshold
    too: + Σ_p max(0, m/2 − (a_p − ½))² + Σ_q max(0, m/2 − (½ − a_q))², so that a present class ends above 0.5 and an
    absent one below, as the pairs alone do not require.
    """
    m = spread_margin(progress)
    a = torch.sigmoid(logits)  # (B, C)
    if not multi_label:
        target = a.gather(1, targets.view(-1, 1))  # (B, 1): a_t
        gaps = F.relu(m - (target - a)).square()  # (B, C): the target's own term is m², removed below
        return (gaps.sum(1) - m**2).mean()
    present = targets > 0.5  # (B, C)
    # pairs (p, q): gap[b, p, q] = m − (a_p − a_q), kept where p is present and q absent
    gaps = F.relu(m - (a.unsqueeze(2) - a.unsqueeze(1))).square()  # (B, C, C)
    pairs = present.unsqueeze(2) & ~present.unsqueeze(1)  # (B, C, C)
    threshold = torch.where(present, F.relu(m / 2 - (a - 0.5)), F.relu(m / 2 - (0.5 - a))).square()  # (B, C)
    return ((gaps * pairs).sum((1, 2)) + threshold.sum(1)).mean()


LOSSES: dict[str, Loss] = {"attention": cross_entropy_loss, "dynamic": margin_loss, "em": spread_loss}


def training_loss(config: ModelConfig) -> Loss:
    """The loss that ``config``'s routing algorithm is trained with (a baseline CNN: cross-entropy)."""
    if not config.has_routing:
        return cross_entropy_loss
    return LOSSES[config.routing_algorithm]
