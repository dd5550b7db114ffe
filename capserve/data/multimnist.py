"""DiverseMultiMNIST (Tsai et al. 2020, after Sabour et al. 2017's MultiMNIST): one or two shifted MNIST digits
on a 36×36 canvas, generated on the device (see ``capserve.data.builtin`` for the choices the paper leaves open)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from capserve.data.splits import Split

CANVAS = 36  # DiverseMultiMNIST canvas side


MAX_SHIFT = 4  # ±pixels per digit


# ------------------------------------------------------------------------------------------ DiverseMultiMNIST


def multimnist(digits: Tensor, labels: Tensor, n: int, generator: torch.Generator, channels: int = 3) -> Split:
    """``n`` DiverseMultiMNIST images from MNIST ``digits`` (N, 28, 28) uint8 and ``labels`` (N,), vectorised.

    Returns a Split with images (n, channels, 36, 36) uint8 (channels replicated, an expanded view) and multi-hot
    targets (n, 10) float32. All randomness comes from ``generator`` (on the digits' device). See the module
    docstring for the recipe.
    """
    dev = digits.device
    N, h, _ = digits.shape
    if N == 0:
        raise ValueError("no MNIST digits to draw from")
    two = torch.rand(n, device=dev, generator=generator) >= 1 / 6  # (n,)
    first = torch.randint(0, N, (n,), device=dev, generator=generator)  # (n,)
    # second digit: a class other than the first's, uniform; then a uniform digit of that class
    order = torch.argsort(labels, stable=True)  # digit indices grouped by class
    counts = torch.bincount(labels, minlength=10)  # (10,)
    starts = torch.cumsum(counts, 0) - counts  # (10,)
    c1 = labels[first]
    c2 = (c1 + torch.randint(1, 10, (n,), device=dev, generator=generator)) % 10  # (n,) never c1
    if (counts == 0).any():
        raise ValueError(f"DiverseMultiMNIST needs digits of all 10 classes, got counts {counts.tolist()}")
    pick = (torch.rand(n, device=dev, generator=generator) * counts[c2]).long().clamp_max(counts[c2] - 1)
    second = order[starts[c2] + pick]  # (n,)
    shifts = torch.randint(-MAX_SHIFT, MAX_SHIFT + 1, (2, n, 2), device=dev, generator=generator)  # (2, n, (dy, dx))
    pad = (CANVAS - h) // 2
    canvas = torch.zeros(n, CANVAS, CANVAS, dtype=torch.int16, device=dev)
    for k, idx in enumerate((first, second)):
        img = _place(digits[idx], shifts[k], pad)  # (n, 36, 36)
        canvas += img if k == 0 else img * two.view(n, 1, 1)
    images = canvas.clamp_(max=255).to(torch.uint8).unsqueeze(1).expand(n, channels, CANVAS, CANVAS)
    targets = torch.zeros(n, 10, device=dev)
    targets[torch.arange(n, device=dev), c1] = 1.0
    targets[torch.arange(n, device=dev)[two], c2[two]] = 1.0
    return Split(images, targets)


def _place(digits: Tensor, shift: Tensor, pad: int) -> Tensor:
    """Digits (n, 28, 28) centred on the canvas and shifted by ``shift`` (n, (dy, dx)): (n, 36, 36) int16."""
    n = len(digits)
    dev = digits.device
    padded = F.pad(digits.to(torch.int16), (pad, pad, pad, pad))  # (n, 36, 36), zeros all round
    ar = torch.arange(CANVAS, device=dev)
    # out[y, x] = padded[y - dy, x - dx]; |shift| <= pad so the wrap-around only ever reads zero padding
    rows = (ar - shift[:, :1]) % CANVAS  # (n, 36)
    cols = (ar - shift[:, 1:]) % CANVAS  # (n, 36)
    return padded[torch.arange(n, device=dev).view(n, 1, 1), rows.unsqueeze(-1), cols.unsqueeze(1)]  # (n, 36, 36)
