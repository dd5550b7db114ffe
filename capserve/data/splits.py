"""``Split`` (images and targets in memory) and the ``--val-size`` rules shared by built-in and own data."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class Split:
    """A dataset split in memory: images (N, C, H, W) uint8, targets (N,) int64 or (N, K) float32 multi-hot."""

    images: Tensor
    targets: Tensor

    def __post_init__(self) -> None:
        assert self.images.dtype == torch.uint8 and self.images.ndim == 4, (self.images.dtype, self.images.shape)
        assert len(self.images) == len(self.targets)

    def __len__(self) -> int:
        return len(self.images)

    def to(self, device: str | torch.device) -> Split:
        return Split(self.images.to(device), self.targets.to(device))

    def subset(self, index: Tensor) -> Split:
        return Split(self.images[index], self.targets[index])


def parse_val_size(text: str) -> int | float:
    """``--val-size``: a count (``500``), a fraction (``0.1``) or a percentage (``10%``)."""
    text = text.strip()
    try:
        if text.endswith("%"):
            return float(text[:-1]) / 100
        return int(text) if text.lstrip("+-").isdigit() else float(text)
    except ValueError:
        message = f"--val-size takes a count (500), a fraction (0.1) or a percentage (10%), got {text!r}"
        raise ValueError(message) from None


def resolve_val_size(val_size: int | float, n: int) -> int:
    """The number of validation images carved from ``n`` training images (``val_size``: a count or a fraction)."""
    if isinstance(val_size, float):
        if not 0 <= val_size < 1:
            raise ValueError(f"--val-size as a fraction must be in [0, 1), got {val_size}")
        count = round(val_size * n)
        return max(count, 1) if val_size > 0 and n > 1 else count
    if not 0 <= val_size < n:
        raise ValueError(f"--val-size must be in [0, {n - 1}] for {n} training images, got {val_size}")
    return val_size
