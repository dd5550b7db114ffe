"""Input preprocessing shared by training, export checks and the service: one definition of "normalised"."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch
from torch import Tensor


class InputSpec(Protocol):
    """What preprocessing needs from a model: ``ModelMetadata`` and ``ModelConfig`` both provide it."""

    in_channels: int
    image_size: int
    mean: Sequence[float]
    std: Sequence[float]


def normalize(images: Tensor, mean: Sequence[float], std: Sequence[float]) -> Tensor:
    """uint8 images (B, C, H, W) in [0, 255] → float32 (x / 255 - mean) / std, on the images' device."""
    if images.dtype != torch.uint8:
        raise TypeError(f"normalize expects uint8 images in [0, 255], got {images.dtype}")
    m = torch.tensor(mean, dtype=torch.float32, device=images.device).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=torch.float32, device=images.device).view(1, -1, 1, 1)
    return (images.float().div_(255) - m) / s


def normalize_numpy(images: np.ndarray, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """``normalize`` for numpy uint8 arrays (B, C, H, W); returns contiguous float32."""
    return normalize(torch.from_numpy(np.ascontiguousarray(images)), mean, std).numpy()


def normalize_images(images: np.ndarray, spec: InputSpec) -> np.ndarray:
    """uint8 (B, C, H, W) → float32 (B, C, H, W) normalised with the model's mean and std."""
    return normalize_numpy(images, spec.mean, spec.std)
