"""Augmentation on whole uint8 batches on the training device, the named policies of ``capserve train --augment``,
and the seeded generator of each epoch.

Policies (``AUGMENTATIONS``):
    none       the images as they are.
    shift      a random translation of up to ``image_size // 8`` pixels (zero padding, then a random crop of the
               original size): the position of things varies.
    crop-flip  the same shift, then a random horizontal mirror (p = 1/2): the authors' CIFAR recipe.

Why the default depends on the data (``default_augment``): a mirror changes what a digit or a letter is, and on
small position-aligned images (digits on a black canvas) a random shift keeps a capsule network at the loss of the
label prior for many epochs: the same stroke lands on other input capsules of the class layer, whose weights are
per capsule, so the label signal spreads thin and the gradients stay ~10x smaller (measured: 0 % exact match after
6 epochs with the shift, 44.8 % without, on two-digit pairs; docs/own-data.md). Photographs keep the CIFAR recipe.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

AUGMENTATIONS = ("none", "shift", "crop-flip")


COLOUR_SPREAD = 4.0  # mean |R-G|+|G-B| (0..255 scale) above which a user's images count as colour photographs


# ------------------------------------------------------------------------------------------------ augmentation


def random_crop_flip(images: Tensor, padding: int = 4, generator: torch.Generator | None = None,
                     flip: bool = True) -> Tensor:  # fmt: skip
    """Random crop of the original size from the zero-padded images, then (``flip``) a random horizontal flip
    (p = 1/2). The flips are drawn either way, so ``flip=False`` gives the same crops as ``flip=True``.

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
    mirror = (torch.rand(B, 1, device=dev, generator=generator) < 0.5) & flip
    rows = dy + torch.arange(H, device=dev)  # (B, H)
    cols = torch.arange(W, device=dev).expand(B, W)  # (B, W)
    cols = dx + torch.where(mirror, cols.flip(-1), cols)  # (B, W)
    b = torch.arange(B, device=dev).view(B, 1, 1)
    out = padded.permute(0, 2, 3, 1)[b, rows.unsqueeze(-1), cols.unsqueeze(1)]  # (B, H, W, C)
    return out.permute(0, 3, 1, 2)  # (B, C, H, W), channels-last strides


def apply_augment(policy: str, images: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """``images`` (B, C, H, W) uint8 under the named policy (``AUGMENTATIONS``); shifts of up to H // 8 pixels."""
    if policy == "none":
        return images
    if policy not in ("shift", "crop-flip"):
        raise ValueError(f"unknown augmentation {policy!r}; choose one of: {', '.join(AUGMENTATIONS)}")
    return random_crop_flip(images, max(1, images.shape[-2] // 8), generator, flip=policy == "crop-flip")


def is_colour(images: Tensor, limit: int = 2048) -> bool:
    """Whether (up to ``limit`` of) the uint8 images (N, C, H, W) carry colour: photographs rather than scans of digits,
    text or other grey-on-black drawings (which RGB files often hold with three equal channels)."""
    if images.shape[1] < 3 or not len(images):
        return False
    x = images[:limit].float()  # (n, C, H, W)
    spread = (x[:, 0] - x[:, 1]).abs().mean() + (x[:, 1] - x[:, 2]).abs().mean()
    return spread.item() > COLOUR_SPREAD


def default_augment(dataset: str, train_images: Tensor | None = None) -> str:
    """The policy a run uses without ``--augment``: ``crop-flip`` for CIFAR and for a user's colour photographs,
    ``none`` for DiverseMultiMNIST (its shifts are built into the generated images) and for a user's grey images
    (digits, text, scans: a mirror changes the label, a shift stalls capsule training)."""
    if dataset in ("cifar10", "cifar100"):
        return "crop-flip"
    if dataset in ("folder", "csv") and train_images is not None and is_colour(train_images):
        return "crop-flip"
    return "none"


def epoch_generator(seed: int, epoch: int, device: str | torch.device) -> torch.Generator:
    """The generator that draws epoch ``epoch``'s training images (and permutation)."""
    return torch.Generator(device=device).manual_seed(seed * 1_000_003 + epoch)
