"""Does where things lie in a picture tell its labels apart? A measurement of a user's training images that chooses
the class capsule layer's transforms (``ModelConfig.class_weights``) for a run on them.

The class capsule layer has, as in the paper, one transform per input capsule, position included: right when a
label has its place (digits, letters and glyphs centred in their picture, photographs framed on their subject), and
slow to learn when the same thing turns up anywhere (a small object on a canvas, shapes in clutter, textures),
where every position has to learn it apart. Shared transforms learn the second kind fast and stall on the first
(docs/own-data.md, the battery). So a run measures which kind its data is.

The measure: each image's map of where its edges lie (grey-level gradient magnitude, pooled to a coarse grid and
scaled to sum to one: where, not how strong, and blind to which colour is in front), then the share of the maps'
variance that the labels explain (η², between-label over total). A share no larger than what the same images give
with their labels shuffled means the labels do not follow position. The figure compared is the ratio of the two.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

GRID = 8  # the side of the coarse grid the edge maps are pooled to
SHUFFLES = 5  # label permutations averaged for the chance level
# η² over its shuffled level at or above which labels follow position: between the battery's sets of things anywhere
# and its sets of things in their place, far from both (docs/own-data.md, "Where things lie")
ALIGNED_RATIO = 4.0


@dataclass(frozen=True)
class Placement:
    """What ``measure_placement`` found: η² of the edge maps by label, its level with shuffled labels, their ratio."""

    explained: float
    shuffled: float

    @property
    def ratio(self) -> float:
        return self.explained / max(self.shuffled, 1e-12)

    @property
    def aligned(self) -> bool:
        """Whether the labels follow where the edges lie (then a transform per position pays)."""
        return self.ratio >= ALIGNED_RATIO

    @property
    def class_weights(self) -> str:
        """The ``ModelConfig.class_weights`` these images call for."""
        return "per_position" if self.aligned else "shared"

    def reason(self) -> str:
        kind = "follow where things lie" if self.aligned else "do not follow where things lie"
        return (
            f"the labels {kind} in the training images (edge-position variance explained {self.ratio:.1f}× the "
            f"shuffled-label level; {ALIGNED_RATIO:g}× or more keeps a transform per position)"
        )


def edge_maps(images: Tensor, block: int = 1024) -> Tensor:
    """Where each image's edges lie: (N, C, H, W) uint8 or float → (N, GRID²), each row summing to 1. Blocks of
    ``block`` images bound the float copies a large data set would otherwise make at once."""
    maps = []
    for start in range(0, len(images), block):
        x = images[start : start + block].float().mean(1, keepdim=True)  # (n, 1, H, W) grey
        dx = F.pad((x[..., :, 1:] - x[..., :, :-1]).abs(), (0, 1, 0, 0))
        dy = F.pad((x[..., 1:, :] - x[..., :-1, :]).abs(), (0, 0, 0, 1))
        maps.append(F.adaptive_avg_pool2d(dx + dy, GRID).flatten(1))  # (n, G²)
    m = torch.cat(maps)
    return m / m.sum(1, keepdim=True).clamp_min(1e-8)


def explained_share(maps: Tensor, targets: Tensor) -> float:
    """η²: the share of the maps' total variance between label groups. Single-label targets (N,) group by label;
    multi-hot targets (N, C) average, over the labels, the split into images with and without each one."""
    centred = maps - maps.mean(0)  # (N, G²)
    total = centred.square().sum()
    if targets.ndim == 1:
        groups = F.one_hot(targets.long()).float()  # (N, C)
    else:
        on = (targets > 0.5).float()
        groups = torch.cat([on, 1 - on], dim=1)  # (N, 2C): each label's images with it, then without
    counts = groups.sum(0).clamp_min(1)  # (K,)
    means = groups.T @ centred / counts[:, None]  # (K, G²): each group's mean, centred
    between = (counts * means.square().sum(1)).sum()
    labels = 1 if targets.ndim == 1 else targets.shape[1]
    return (between / total.clamp_min(1e-12)).item() / labels


def measure_placement(images: Tensor, targets: Tensor, seed: int = 0) -> Placement:
    """How far the labels of ``images`` (N, C, H, W) follow where things lie, against the same with shuffled labels.

    Args:
        targets: (N,) class indices, or (N, C) multi-hot.
    """
    maps = edge_maps(images)
    generator = torch.Generator().manual_seed(seed)
    shuffled = [
        explained_share(maps, targets[torch.randperm(len(targets), generator=generator)]) for _ in range(SHUFFLES)
    ]
    return Placement(explained_share(maps, targets), sum(shuffled) / SHUFFLES)
