"""Augmentation on whole uint8 batches on the training device, the named policies of ``capserve train --augment``,
and the seeded generator of each epoch.

Policies (``AUGMENTATIONS``):
    none       the images as they are.
    shift      a random translation of up to ``image_size // 8`` pixels (zero padding, then a random crop of the
               original size): the position of things varies.
    crop-flip  the same shift, then a random horizontal mirror (p = 1/2): the authors' CIFAR recipe.

Why the default depends on the data (``default_augment``): a mirror changes what a digit or a letter is, and on a
user's few thousand images a random shift keeps a capsule network at the loss of the label prior for many epochs:
the same part lands on other input capsules of the class layer, whose weights are per capsule, so the label signal
spreads thin (docs/research/augmentation.md). CIFAR keeps the authors' recipe. A capsule network on few pictures a
class whose labels follow where things lie and survive a mirror takes crop-flip (``capserve.train.few_images``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

AUGMENTATIONS = ("none", "shift", "crop-flip")


# ------------------------------------------------------------------------------------------------ augmentation


def random_crop_flip(
    images: Tensor, padding: int = 4, generator: torch.Generator | None = None, flip: bool = True
) -> Tensor:
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


def default_augment(dataset: str) -> str:
    """The policy a run uses without ``--augment`` (``augment_reason`` says why)."""
    return "crop-flip" if dataset in ("cifar10", "cifar100") else "none"


def augment_reason(dataset: str) -> str:
    """Why ``default_augment`` chose its policy for ``dataset``, in the words a run's log uses."""
    if dataset in ("cifar10", "cifar100"):
        return "the authors' CIFAR recipe"
    if dataset == "multimnist":
        return "DiverseMultiMNIST's shifts are built into its generated images"
    return (
        "the default for your own images: a shift or a mirror held short capsule runs near the label prior on the "
        "own-data battery (docs/own-data.md); give --augment crop-flip for photographs in a long run"
    )


def epoch_generator(seed: int, epoch: int, device: str | torch.device) -> torch.Generator:
    """The generator that draws epoch ``epoch``'s training images (and permutation)."""
    return torch.Generator(device=device).manual_seed(seed * 1_000_003 + epoch)
