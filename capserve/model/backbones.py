"""Backbones: the convolutional stems in front of the primary capsules (or of a baseline CNN's read-out).

Capsule poses travel between layers channel-last: (B, H, W, I, D) on a grid, (B, I, D) after a fully
connected capsule layer. Routing itself lives in ``capserve.routing``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn.functional as F
from torch import Tensor, nn

from capserve.configs import ModelConfig


class BasicBlock(nn.Module):
    """ResNet basic block (two 3×3 convs + BN), projection shortcut when the shape changes."""

    def __init__(self, in_channels: int, channels: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_channels != channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, channels, 1, stride=stride, bias=False), nn.BatchNorm2d(channels)
            )

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


def resnet_backbone(in_channels: int, channels: int, stride: int) -> nn.Sequential:
    """The authors' CIFAR ResNet stem: conv3×3-64 + BN + ReLU, 3 blocks at 64, 4 at ``channels`` (first strided)."""
    blocks = [BasicBlock(64, 64) for _ in range(3)]
    blocks += [BasicBlock(64, channels, stride)] + [BasicBlock(channels, channels) for _ in range(3)]
    return nn.Sequential(
        nn.Conv2d(in_channels, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True), *blocks
    )


def simple_backbone(in_channels: int, channels: int, stride: int) -> nn.Sequential:
    """One biased conv3×3 + ReLU."""
    return nn.Sequential(nn.Conv2d(in_channels, channels, 3, stride=stride, padding=1), nn.ReLU(inplace=True))


def conv_backbone(
    in_channels: int, channels: int, stride: int, pool: int = 1, layers: int = 3, blocks: int = 0
) -> nn.Sequential:
    """``layers`` conv3×3 + BatchNorm + ReLU layers: 64 channels at full size, then ``channels`` at stride ``stride``,
    then ``channels`` again for the rest, on that grid: the features a plain CNN's first layers would give. ``pool``
    > 1 max-pools the first layer's output by that factor: the first layer still sees every pixel of a large image,
    the rest cost what they cost at the smaller size."""

    def layer(i: int, o: int, s: int) -> list[nn.Module]:
        return [nn.Conv2d(i, o, 3, stride=s, padding=1, bias=False), nn.BatchNorm2d(o), nn.ReLU(inplace=True)]

    stem = [*layer(in_channels, 64, 1), *([nn.MaxPool2d(pool)] if pool > 1 else [])]
    rest = [module for _ in range(layers - 2) for module in layer(channels, channels, 1)]
    residual = [BasicBlock(channels, channels) for _ in range(blocks)]
    return nn.Sequential(*stem, *layer(64, channels, stride), *rest, *residual)


def resnet18_backbone(in_channels: int, channels: int = 64) -> nn.Sequential:
    """The CIFAR ResNet-18 body: conv3×3-c + BN + ReLU, then [2, 2, 2, 2] BasicBlocks at c, 2c, 4c, 8c channels with
    strides 1, 2, 2, 2 (c = 64 in ResNet-18). (B, C_in, H, W) → (B, 8c, ⌈H/8⌉, ⌈W/8⌉)."""
    widths = [channels, 2 * channels, 4 * channels, 8 * channels]
    blocks: list[nn.Module] = []
    for i, width in enumerate(widths):
        previous = widths[max(i - 1, 0)]
        blocks += [BasicBlock(previous, width, stride=1 if i == 0 else 2), BasicBlock(width, width)]
    return nn.Sequential(
        nn.Conv2d(in_channels, channels, 3, padding=1, bias=False),
        nn.BatchNorm2d(channels),
        nn.ReLU(inplace=True),
        *blocks,
    )


# ``ModelConfig.backbone`` → the stem it builds, (B, in_channels, H, W) → (B, channels, h, w); the one table of
# backbone names (``build_model`` refuses any other). resnet18 is a whole CNN body: the baselines' own.
BACKBONES: dict[str, Callable[[ModelConfig], nn.Sequential]] = {
    "resnet": lambda c: resnet_backbone(c.in_channels, c.backbone_channels, c.backbone_stride),
    "simple": lambda c: simple_backbone(c.in_channels, c.backbone_channels, c.backbone_stride),
    "conv": lambda c: conv_backbone(
        c.in_channels, c.backbone_channels, c.backbone_stride, c.stem_pool, c.backbone_layers, c.backbone_blocks
    ),
    "resnet18": lambda c: resnet18_backbone(c.in_channels, c.backbone_channels),
}
