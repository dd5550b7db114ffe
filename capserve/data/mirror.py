"""Do the labels survive a mirror? A measurement of a user's training images that lets a capsule run on few of them
mirror its training images (``capserve.train.few_images``).

A mirror keeps a photograph's label (a cat facing left is a cat) and changes that of a digit, a letter, an arrow, or
"a cat turned by 90 degrees" (mirrored, it is turned by 270). The measure takes the two views of
``capserve.data.placement`` (where the edges lie, and the edges' shift-free spectrum), and splits each image's view
into the part a mirror keeps, (v(x) + v(mirrored x)) / 2, and the part it turns round, (v(x) - v(mirrored x)) / 2.
Where the labels survive a mirror, each label's images are as likely mirrored as not, and only the kept part tells
the labels apart: in each view, η² in the turned part (above its shuffled-label chance) is a small share of η² in the
kept part. Labels that a mirror changes show in the turned part of at least one view.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from capserve.data.placement import above_chance, edge_maps, spectrum_maps

__all__ = ["MIRROR_SHARE", "Mirror", "measure_mirror"]

# the most of what the labels show (in either view) that may lie in the part a mirror turns round: between the
# battery's sets whose labels a mirror keeps and those it changes, far from both (docs/research/augmentation.md)
MIRROR_SHARE = 0.1


@dataclass(frozen=True)
class Mirror:
    """What ``measure_mirror`` found, per view (where the edges lie, their shift-free spectrum): η² of the labels
    above chance in the part of the view a mirror keeps and in the part it turns round, and the kept part's chance."""

    kept: tuple[float, float]
    turned: tuple[float, float]
    kept_chance: tuple[float, float]

    @property
    def share(self) -> float:
        """The largest share, over the views that show the labels (η² in the kept part at least twice its chance, so
        that noise never decides), of what the labels show that lies in the part a mirror turns round; infinite
        where no view shows them."""
        views = zip(self.kept, self.turned, self.kept_chance, strict=True)
        return max((t / k for k, t, c in views if k >= max(c, 1e-12)), default=float("inf"))

    @property
    def survives(self) -> bool:
        """Whether a mirrored image keeps its label: a view shows the labels, and in none does the part a mirror
        turns round tell them apart."""
        return self.share < MIRROR_SHARE

    def reason(self) -> str:
        kind = "survive" if self.survives else "may not survive"
        return (
            f"the labels {kind} a mirror (what a mirror turns round explains {self.share:.2f} of what it keeps; "
            f"below {MIRROR_SHARE:g} is a mirror's label kept)"
        )


def measure_mirror(images: Tensor, targets: Tensor, seed: int = 0) -> Mirror:
    """How far the labels of ``images`` (N, C, H, W) survive a horizontal mirror (``Mirror``).

    Args:
        targets: (N,) class indices, or (N, C) multi-hot.
    """
    generator = torch.Generator().manual_seed(seed)
    kept, turned, kept_chance = [], [], []
    for view in (edge_maps, spectrum_maps):
        plain, mirrored = view(images), view(images.flip(-1))  # (N, G) each
        above, chance = above_chance((plain + mirrored) / 2, targets, generator)
        kept.append(above)
        kept_chance.append(chance)
        turned.append(above_chance((plain - mirrored) / 2, targets, generator)[0])
    return Mirror(tuple(kept), tuple(turned), tuple(kept_chance))
