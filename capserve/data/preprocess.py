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


def data_mean_std(images: Tensor, chunk: int = 4096) -> dict[str, tuple[float, ...]]:
    """Per-channel mean and std of uint8 images (N, C, H, W) on the 0..1 scale, rounded to 4 digits (the std at
    least 1/255, so that a constant channel does not divide by zero); summed in float64 one chunk at a time."""
    C = images.shape[1]
    sums = torch.zeros(2, C, dtype=torch.float64)
    for start in range(0, len(images), chunk):
        x = images[start : start + chunk].to("cpu", torch.float64) / 255  # (n, C, H, W)
        sums += torch.stack([x.sum((0, 2, 3)), (x * x).sum((0, 2, 3))])
    n = max(images.numel() // max(C, 1), 1)
    mean = sums[0] / n
    std = (sums[1] / n - mean**2).clamp_min(0).sqrt().clamp_min(1 / 255)
    return {"mean": tuple(round(v, 4) for v in mean.tolist()), "std": tuple(round(v, 4) for v in std.tolist())}
