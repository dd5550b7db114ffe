"""Training losses, one per routing algorithm, each as its own paper trains it.

Every model returns logits (B, C) whatever its routing, so that serving, evaluation and export never ask which
routing a model uses; a routing whose paper scores capsules by length or activation in (0, 1) returns that score
as a logit (sigmoid(logit) = score), and its loss reads the score back with ``torch.sigmoid``.

- ``attention`` (inverted dot-product attention, Tsai et al. 2020): cross-entropy for single-label tasks, binary
  cross-entropy per class for multi-label ones, on the linear read-out of the class capsules.
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


LOSSES: dict[str, Loss] = {"attention": cross_entropy_loss, "em": spread_loss}


def training_loss(config: ModelConfig) -> Loss:
    """The loss that ``config``'s routing algorithm is trained with."""
    return LOSSES[config.routing_algorithm]
