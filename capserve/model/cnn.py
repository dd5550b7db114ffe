"""Baseline CNNs for the paper's comparisons: the capsule networks' backbones with plain layers in place of capsules.

A config with ``head="avgpool"`` or ``head="fc"`` builds a ``CNN`` (``capserve.create_model`` and ``capserve.load``
choose the class from the config). Each capsule layer becomes a layer with as many neurons as the capsules it
replaces (types × pose_dim):

- the primary capsules: conv to primary_types × pose_dim channels (same kernel, stride, padding);
- each conv capsule layer: conv to types × pose_dim channels (same kernel and stride, no padding);
- the read-out of the last feature map: global average pooling (``"avgpool"``), or a learned fully connected layer
  over the flattened map in its place (``"fc"``);
- each fc capsule layer: a fully connected layer to types × pose_dim units (with ``"fc"``, the first of them is the
  learned layer over the flattened map);
- the class capsules and their logit head: one linear classifier to the classes.

Convs are bias-free and followed by BatchNorm and ReLU (the CNN's counterpart of the capsules' LayerNorm; the paper
does not give its CNN's normalisation), fully connected layers by ReLU. The ``resnet18`` backbone is a whole
ResNet-18 body: its head follows it directly.

CNNs have no routing: ``iterations`` must be left unset (None) wherever a capsule network takes it, and there is no
``trace()`` (nothing to explain).
"""

from __future__ import annotations

from pathlib import Path

from torch import Tensor, nn

from capserve.configs import ModelConfig
from capserve.model.backbones import BACKBONES
from capserve.model.checkpoint import save_model


def conv_bn_relu(in_channels: int, channels: int, kernel: int, stride: int, padding: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(in_channels, channels, kernel, stride=stride, padding=padding, bias=False),
        nn.BatchNorm2d(channels),
        nn.ReLU(inplace=True),
    )


class CNN(nn.Module):
    """A baseline CNN built from a capsule network's config (see the module docstring).

    Example:
        >>> model = capserve.create_model("cifar10-resnet18")
        >>> model(torch.randn(8, 3, 32, 32)).shape
        torch.Size([8, 10])
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        if config.has_routing:
            raise ValueError(f"{config.name} has head {config.head!r}: build it with CapsNet (capserve.create_model)")
        self.config = c = config
        self.backbone = BACKBONES[c.backbone](c)
        if c.backbone == "resnet18":
            self.convs = nn.Sequential()
            channels, side, dense = 8 * c.backbone_channels, c.feature_size, []
        else:
            channels = c.primary_types * c.pose_dim
            convs = [conv_bn_relu(c.backbone_channels, channels, c.primary_kernel, c.primary_stride, c.primary_padding)]
            for layer in c.capsules:
                if layer.kind == "conv":
                    convs.append(conv_bn_relu(channels, layer.types * c.pose_dim, layer.kernel_size, layer.stride, 0))
                    channels = layer.types * c.pose_dim
            self.convs = nn.Sequential(*convs)
            side = c.spatial_sizes[-1]
            dense = [layer.types * c.pose_dim for layer in c.capsules if layer.kind == "fc"]
        if c.head == "avgpool":
            readout: list[nn.Module] = [nn.AdaptiveAvgPool2d(1), nn.Flatten()]  # (B, channels)
            width = channels
        else:
            readout, width = [nn.Flatten()], channels * side * side  # (B, channels·h·w), in (channel, h, w) order
        layers: list[nn.Module] = []
        for units in dense:
            layers += [nn.Linear(width, units), nn.ReLU(inplace=True)]
            width = units
        self.head = nn.Sequential(*readout, *layers)
        self.classifier = nn.Linear(width, c.num_classes)

    def forward(self, x: Tensor, iterations: int | None = None) -> Tensor:
        """Logits (B, C) for images (B, C_in, H, W); ``iterations`` must be None (a CNN has no routing)."""
        self.resolve_iterations(iterations)
        if x.ndim != 4 or x.shape[1] != self.config.in_channels:
            raise ValueError(f"expected images (B, {self.config.in_channels}, H, W), got {tuple(x.shape)}")
        features = self.convs(self.backbone(x))  # (B, channels, h, w)
        return self.classifier(self.head(features))  # (B, C)

    def resolve_iterations(self, iterations: int | None) -> None:
        """None: what a CNN runs with. A number is a mistake the caller should hear about."""
        if iterations is not None:
            c = self.config
            raise ValueError(
                f"{c.name} is a CNN (head {c.head!r}) without routing: routing iterations do not apply "
                f"(got {iterations!r}); leave them unset"
            )

    def save(self, directory: str | Path) -> Path:
        """Write ``model.safetensors`` and ``config.json`` into ``directory`` (see ``capserve.load``)."""
        return save_model(self, directory)
