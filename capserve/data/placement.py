"""Does where things lie in a picture tell its labels apart? A measurement of a user's training images that chooses
the class capsule layer's transforms (``ModelConfig.class_weights``) for a run on them.

The class capsule layer has, as in the paper, one transform per input capsule, position included: right when a
label has its place (digits, letters and glyphs centred in their picture, photographs framed on their subject), and
slow to learn when the same thing turns up anywhere (a small object on a canvas, shapes in clutter, textures, an
arrow whose label is the way it points), where every position has to learn it apart. Shared transforms learn the
second kind fast and stall on the first (docs/research/own-data-battery.md). So a run measures which kind its data is.

The measure compares two views of each image's edges (grey-level gradient magnitude, blind to which colour is in
front): where they lie (pooled to a coarse grid) and their Fourier magnitude (the same whatever the shift). In each
view, η² is the share of the maps' variance that the labels explain, less what shuffled labels explain. The figure
is the first over the second: how much of what sets the labels apart depends on where it is. An arrow's direction
shows in both views (east-pointing arrows spread sideways), but far more in the shift-free one, so a share of
variance alone would call arrows anywhere "in their place"; the ratio does not.

Where the labels do not follow where things lie, a second figure tells small things anywhere (a letter, a few shapes)
from pictures that things fill (textures, photographs): how much of the picture the edges fill. A run on small
things max-pools its stem in place of the strided layer, whose sampling a small thing's shift changes
(``capserve.train.stem.pooled_stem``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

GRID = 8  # the side of the coarse grid the edge maps are pooled to
SHUFFLES = 5  # label permutations averaged for the chance level
# in-place over shift-free η² at or above which labels follow position: between the battery's sets of things anywhere
# and its sets of things in their place, far from both (docs/research/where-things-lie.md)
ALIGNED_RATIO = 0.15
# the share of the picture its edges fill below which its things are small: between the battery's sets of small things
# anywhere and its textures and photographs (docs/research/backbone.md, the max-pool for small things anywhere)
SMALL_SPREAD = 0.5


@dataclass(frozen=True)
class Placement:
    """What ``measure_placement`` found: η² of the labels above its chance level (the same with shuffled labels), in
    where the edges lie and in the edges' shift-free spectrum, and those two chance levels; and how much of the
    picture the edges fill (``edge_spread``)."""

    in_place: float
    shift_free: float
    in_place_chance: float
    shift_free_chance: float
    spread: float

    @property
    def ratio(self) -> float:
        """How much of what sets the labels apart depends on where it is (in place over shift-free)."""
        return self.in_place / max(self.shift_free, self.shift_free_chance, 1e-12)

    @property
    def aligned(self) -> bool:
        """Whether the labels follow where the edges lie (then a transform per position pays): clear of chance (η² at
        least twice its shuffled level, so that noise never decides) and a large enough part of what the labels
        show."""
        return self.in_place >= self.in_place_chance and self.ratio >= ALIGNED_RATIO

    @property
    def class_weights(self) -> str:
        """The ``ModelConfig.class_weights`` these images call for."""
        return "per_position" if self.aligned else "shared"

    @property
    def small_things(self) -> bool:
        """Whether the labels are small things anywhere: not where they lie, and edges in under ``SMALL_SPREAD`` of
        the picture."""
        return not self.aligned and self.spread < SMALL_SPREAD

    def reason(self) -> str:
        kind = "follow where things lie" if self.aligned else "do not follow where things lie"
        return (
            f"the labels {kind} in the training images (where the edges lie explains {self.ratio:.2f} of what "
            f"their shift-free spectrum explains; {ALIGNED_RATIO:g} or more keeps a transform per position)"
        )


def _edges(images: Tensor, block: int) -> Iterator[Tensor]:
    """Grey-level gradient magnitude of ``images`` (N, C, H, W), in blocks of ``block`` images: (n, 1, H, W) each.
    Blocks bound the float copies a large data set would otherwise make at once."""
    for start in range(0, len(images), block):
        x = images[start : start + block].float().mean(1, keepdim=True)  # (n, 1, H, W) grey
        dx = F.pad((x[..., :, 1:] - x[..., :, :-1]).abs(), (0, 1, 0, 0))
        dy = F.pad((x[..., 1:, :] - x[..., :-1, :]).abs(), (0, 0, 0, 1))
        yield dx + dy


def _sum_to_one(maps: Tensor) -> Tensor:
    return maps / maps.sum(1, keepdim=True).clamp_min(1e-8)


def edge_maps(images: Tensor, block: int = 1024) -> Tensor:
    """Where each image's edges lie: (N, C, H, W) uint8 or float → (N, GRID²), each row summing to 1."""
    return _sum_to_one(torch.cat([F.adaptive_avg_pool2d(e, GRID).flatten(1) for e in _edges(images, block)]))


def edge_spread(maps: Tensor) -> float:
    """How much of the picture the edges of ``edge_maps`` (N, GRID²) fill, from 1/GRID² (all in one cell) to 1 (even
    over every cell): each map's participation ratio, 1 / (GRID² Σ p²), averaged over the images."""
    return (1 / (maps.square().sum(1) * maps.shape[1])).mean().item()


def spectrum_maps(images: Tensor, block: int = 1024) -> Tensor:
    """What each image's edges are, wherever they lie: the Fourier magnitude of the edge map (unchanged by a shift),
    pooled to a GRID × (GRID/2 + 1) grid of frequencies → (N, GRID·(GRID/2 + 1)), each row summing to 1."""
    maps = []
    for e in _edges(images, block):
        magnitude = torch.fft.rfft2(e - e.mean((-2, -1), keepdim=True)).abs()  # (n, 1, H, W/2 + 1)
        magnitude = torch.fft.fftshift(magnitude, dim=-2)  # vertical frequencies in order, so that pools are bands
        maps.append(F.adaptive_avg_pool2d(magnitude, (GRID, GRID // 2 + 1)).flatten(1))
    return _sum_to_one(torch.cat(maps))


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


def above_chance(maps: Tensor, targets: Tensor, generator: torch.Generator) -> tuple[float, float]:
    """η² of ``targets`` in ``maps`` less its chance level, and that chance level: the mean η² of ``SHUFFLES``
    permutations of the targets (drawn from ``generator``)."""
    shuffled = sum(
        explained_share(maps, targets[torch.randperm(len(targets), generator=generator)]) for _ in range(SHUFFLES)
    )
    return explained_share(maps, targets) - shuffled / SHUFFLES, shuffled / SHUFFLES


def measure_placement(images: Tensor, targets: Tensor, seed: int = 0) -> Placement:
    """How far the labels of ``images`` (N, C, H, W) follow where things lie: their η² above chance in the edges'
    positions, and in the edges' shift-free spectrum; and how much of the picture the edges fill.

    Args:
        targets: (N,) class indices, or (N, C) multi-hot.
    """
    generator = torch.Generator().manual_seed(seed)
    edges = edge_maps(images)
    in_place, in_place_chance = above_chance(edges, targets, generator)
    shift_free, shift_free_chance = above_chance(spectrum_maps(images), targets, generator)
    return Placement(in_place, shift_free, in_place_chance, shift_free_chance, edge_spread(edges))
