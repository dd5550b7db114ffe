"""Augmentation on whole uint8 batches on the training device, and the seeded generator of each epoch."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

# ------------------------------------------------------------------------------------------------ augmentation


def random_crop_flip(images: Tensor, padding: int = 4, generator: torch.Generator | None = None) -> Tensor:
    """Random crop of the original size from the zero-padded images, then a random horizontal flip (p = 1/2).

    Args:
        images: (B, C, H, W) on any device; ``generator`` must live on the same device.
    Returns:
        (B, C, H, W), same dtype, channels-last in memory.
    """
    B, _, H, W = images.shape
    dev = images.device
    padded = F.pad(images, (padding, padding, padding, padding))  # (B, C, H+2p, W+2p)
    dy = torch.randint(0, 2 * padding + 1, (B, 1), device=dev, generator=generator)
    dx = torch.randint(0, 2 * padding + 1, (B, 1), device=dev, generator=generator)
    flip = torch.rand(B, 1, device=dev, generator=generator) < 0.5
    rows = dy + torch.arange(H, device=dev)  # (B, H)
    cols = torch.arange(W, device=dev).expand(B, W)  # (B, W)
    cols = dx + torch.where(flip, cols.flip(-1), cols)  # (B, W)
    b = torch.arange(B, device=dev).view(B, 1, 1)
    out = padded.permute(0, 2, 3, 1)[b, rows.unsqueeze(-1), cols.unsqueeze(1)]  # (B, H, W, C)
    return out.permute(0, 3, 1, 2)  # (B, C, H, W), channels-last strides


def epoch_generator(seed: int, epoch: int, device: str | torch.device) -> torch.Generator:
    """The generator that draws epoch ``epoch``'s training images (and permutation)."""
    return torch.Generator(device=device).manual_seed(seed * 1_000_003 + epoch)
