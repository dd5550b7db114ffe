"""Network layers: the two CIFAR backbones, primary capsules and routed capsule layers.

Capsule poses travel between layers channel-last: (B, H, W, I, D) on a grid, (B, I, D) after a fully
connected capsule layer. Routing itself lives in ``capserve.routing``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from capserve import routing
from capserve.configs import CapsuleLayerConfig


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


def resnet18_backbone(in_channels: int, channels: int = 64) -> nn.Sequential:
    """The CIFAR ResNet-18 body: conv3×3-c + BN + ReLU, then [2, 2, 2, 2] BasicBlocks at c, 2c, 4c, 8c channels with
    strides 1, 2, 2, 2 (c = 64 in ResNet-18). (B, C_in, H, W) → (B, 8c, ⌈H/8⌉, ⌈W/8⌉)."""
    widths = [channels, 2 * channels, 4 * channels, 8 * channels]
    blocks: list[nn.Module] = []
    for i, width in enumerate(widths):
        previous = widths[max(i - 1, 0)]
        blocks += [BasicBlock(previous, width, stride=1 if i == 0 else 2), BasicBlock(width, width)]
    return nn.Sequential(
        nn.Conv2d(in_channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU(inplace=True),
        *blocks,
    )  # fmt: skip


# backbone name → builder(in_channels, channels, stride) of the capsule networks (resnet18 is the CNNs' own)
BACKBONES = {"resnet": resnet_backbone, "simple": simple_backbone}


def pose_norm(dim: int, enabled: bool) -> nn.Module:
    return nn.LayerNorm(dim) if enabled else nn.Identity()


class PrimaryCapsules(nn.Module):
    """A bias-free conv to types × D channels; each D-vector is one capsule's pose, LayerNorm'd."""

    def __init__(self, in_channels: int, types: int, pose_dim: int, kernel: int, stride: int, padding: int,
                 layer_norm: bool = True):  # fmt: skip
        super().__init__()
        self.types, self.pose_dim = types, pose_dim
        self.conv = nn.Conv2d(in_channels, types * pose_dim, kernel, stride=stride, padding=padding, bias=False)
        self.norm = pose_norm(pose_dim, layer_norm)

    def forward(self, features: Tensor) -> Tensor:
        if self.conv.kernel_size == (1, 1):
            # a channels-last 1×1 conv writes (B, H, W, I·D) in memory, so the permute below is a free view
            # (measured faster on CPU for 1×1; slower for the 3×3 stride-2 MultiMNIST conv, which stays as is)
            features = features.contiguous(memory_format=torch.channels_last)
        u = self.conv(features)  # (B, I·D, H, W)
        B, _, H, W = u.shape
        u = u.permute(0, 2, 3, 1).reshape(B, H, W, self.types, self.pose_dim)  # (B, H, W, I, D)
        return self.norm(u)


def group_children(u: Tensor, kind: str, kernel_size: int, stride: int) -> Tensor:
    """Capsules grouped by the parent position they reach: (B, P, N, D), N in (kh, kw, I) order for conv (the
    k×k window over all child types at stride s, no padding), all children in (H, W, I) order for fc (P = 1)."""
    if kind == "fc":
        return u.reshape(u.shape[0], 1, -1, u.shape[-1])  # (B, 1, N, D)
    k, s = kernel_size, stride
    windows = u.unfold(1, k, s).unfold(2, k, s)  # (B, h, w, I, D, k, k)
    B, h, w, I, D = windows.shape[:5]
    return windows.permute(0, 1, 2, 5, 6, 3, 4).reshape(B, h * w, k * k * I, D)  # (B, P, N, D)


def parents_layout(parents: Tensor, u: Tensor, kind: str, kernel_size: int, stride: int) -> Tensor:
    """Parents (B, P, J, D) of children ``u`` → the layer's output layout: (B, h, w, J, D) for conv, (B, J, D) fc."""
    B, P, J, D = parents.shape
    if kind == "fc":
        return parents.view(B, J, D)  # (B, J, D)
    side = (u.shape[1] - kernel_size) // stride + 1
    return parents.view(B, side, P // side, J, D)  # (B, h, w, J, D)


class CapsuleLayer(nn.Module):
    """Parents routed from children by inverted dot-product attention; a conv layer or a fully connected one.

    Conv: the children of the parent at (h, w) are the true k×k window (stride s, no padding) over all child
    types, with weights shared across positions. FC: every child capsule (all types and positions) is a child
    of every parent.

    Args:
        config: kind, parent types J, kernel and stride.
        in_types: child capsule types I.
        in_size: side of the child grid (0 when the children come from an fc layer).
        pose: "matrix" or "vector"; pose_dim D is the same for children and parents.
    Shapes:
        children: (B, H, W, I, D) or (B, I, D); parents: (B, h, w, J, D) (conv) or (B, J, D) (fc).
    """

    def __init__(self, config: CapsuleLayerConfig, in_types: int, in_size: int, pose: str, pose_dim: int,
                 layer_norm: bool = True, activations: bool = False):  # fmt: skip
        super().__init__()
        self.kind, self.kernel_size, self.stride = config.kind, config.kernel_size, config.stride
        self.types = config.types
        side = math.isqrt(pose_dim)
        x, y = (side, side) if pose == "matrix" else (pose_dim, pose_dim)
        if config.kind == "conv":
            n = config.kernel_size**2 * in_types
            fan_in = in_types * config.kernel_size**2
        else:
            n = in_types * max(in_size, 1) ** 2
            fan_in = n
        # the authors' init: N(0, 1) · √(J / (√D·N_in·K²)) for matrix poses (D_in in place of √D for vectors)
        std = math.sqrt(config.types / (x * fan_in))
        self.weight = nn.Parameter(torch.randn(n, config.types, x, y) * std)  # (N, J, X, Y), N = (kh, kw, I)
        self.norm = pose_norm(pose_dim, layer_norm)
        self.activation = nn.Linear(pose_dim, 1) if activations else None

    def _activate(self, u: Tensor) -> Tensor:
        if self.activation is not None:
            u = u * torch.sigmoid(self.activation(u))  # capsule activations ablation: scale each child pose
        return u

    def group_children(self, u: Tensor) -> Tensor:
        """Child poses grouped by the parent position they reach: (B, P, N, D)."""
        return group_children(self._activate(u), self.kind, self.kernel_size, self.stride)

    def _grid(self, parents: Tensor, u: Tensor) -> Tensor:
        """(B, P, J, D) → the layer's output layout."""
        return parents_layout(parents, u, self.kind, self.kernel_size, self.stride)

    def route(self, u: Tensor, iterations: int, keep_coefficients: bool = False) -> tuple[Tensor, Tensor | None]:
        """All ``iterations`` of this layer with its children fixed (the sequential schedule)."""
        parents, coefficients = self(u)
        for _ in range(iterations - 1):
            parents, coefficients = self(u, parents, keep_coefficients)
        return parents, coefficients

    def forward(self, u: Tensor, parents: Tensor | None = None, keep_coefficients: bool = False
                ) -> tuple[Tensor, Tensor | None]:  # fmt: skip
        """One routing iteration: uniform when ``parents`` is None, else attention to the given parents.

        Returns the new parent poses and, with ``keep_coefficients``, the routing coefficients (B, P, N, J) of an
        attention step (None otherwise, and always None for the uniform step).
        """
        if parents is None and self.kind == "conv":  # straight from the grid: no (B, P, N, D) window copy
            grid = routing.uniform_conv_step(self._activate(u), self.weight, self.kernel_size, self.stride, self.norm)
            return grid, None
        children = self.group_children(u)
        if parents is None:
            return self._grid(routing.uniform_step(children, self.weight, self.norm), u), None
        B, J, D = parents.shape[0], parents.shape[-2], parents.shape[-1]
        new, coefficients = routing.routing_step(
            children, self.weight, parents.reshape(B, -1, J, D), self.norm, keep_coefficients
        )
        return self._grid(new, u), coefficients


# ------------------------------------------------------------------------------------- dynamic routing (Sabour 2017)


class Squash(nn.Module):
    """``routing.squash`` as a module: a vector's direction kept, its length mapped into [0, 1)."""

    def forward(self, s: Tensor) -> Tensor:
        return routing.squash(s)


class SquashedPrimaryCapsules(PrimaryCapsules):
    """Sabour et al.'s PrimaryCaps: a bias-free conv to types × D channels, each D-vector squashed (no LayerNorm).

    Shapes: features (B, C, H, W) → poses (B, h, w, I, D) with lengths in [0, 1). ``layer_norm`` must be False:
    the squash takes LayerNorm's place.
    """

    def __init__(self, in_channels: int, types: int, pose_dim: int, kernel: int, stride: int, padding: int,
                 layer_norm: bool = False):  # fmt: skip
        if layer_norm:
            raise ValueError("dynamic routing squashes its capsules instead of LayerNorm: set layer_norm=False")
        super().__init__(in_channels, types, pose_dim, kernel, stride, padding, layer_norm=False)
        self.norm = Squash()


class DynamicCapsuleLayer(CapsuleLayer):
    """Parents routed from children by dynamic routing (Sabour et al., 2017); a conv layer or a fully connected one.

    Children and windows as in ``CapsuleLayer`` (whose weights, window gathering and output layout it shares),
    with vector poses only: û_{j|i} = W_ij u_i, coupling logits updated by agreement for all ``iterations`` rounds
    at once (``routing.dynamic_routing``), parents squashed. A parent's length is the probability that its entity
    is present; the class layer reads it out as a logit (``class_logits``).

    Shapes:
        children: (B, H, W, I, D) or (B, I, D); parents: (B, h, w, J, D) (conv) or (B, J, D) (fc).
    Example:
        >>> layer = DynamicCapsuleLayer(CapsuleLayerConfig("fc", 10), 8, 0, "vector", 16)
        >>> parents, _ = layer(routing.squash(torch.randn(4, 8, 16)), iterations=3)
        >>> layer.class_logits(parents).shape
        torch.Size([4, 10])
    """

    # lengths are clamped to [1e-12, 1 − 1e-6] before the logit: finite logits in [-27.6, 13.8], and only lengths
    # out of float32's reach of 1 (|s| > 1000) or exactly 0 lose their gradient
    MIN_LENGTH, LENGTH_EPS = 1e-12, 1e-6

    def __init__(self, config: CapsuleLayerConfig, in_types: int, in_size: int, pose: str, pose_dim: int,
                 layer_norm: bool = False, activations: bool = False):  # fmt: skip
        if pose != "vector" or layer_norm or activations:
            raise ValueError(
                "dynamic routing has vector poses, squashed: set pose='vector', layer_norm=False, activations=False"
            )
        super().__init__(config, in_types, in_size, pose, pose_dim, layer_norm=False, activations=False)
        # W ~ N(0, 1/D_out): each vote is about as long as its child (E|û_j|i|² = |u_i|²), so that the agreements
        # <û_j|i, v_j> start below 1 and the first rounds route softly; the lengths then start short and grow
        # under the margin loss (our choice: the paper gives no init. Measured on
        # multimnist-capsnet-small: a scale that keeps |s_j| ≈ |u_i| at uniform coupling, ~J/√N times larger, made
        # routing near one-hot at the start and SGD oscillate, with the lengths saturating).
        nn.init.normal_(self.weight, std=pose_dim**-0.5)

    def route(self, u: Tensor, iterations: int, keep_coefficients: bool = False) -> tuple[Tensor, Tensor | None]:
        """All ``iterations`` rounds with the children fixed; see ``forward``."""
        return self(u, iterations, keep_coefficients)

    def forward(self, u: Tensor, iterations: int = 3, keep_coefficients: bool = False  # type: ignore[override]
                ) -> tuple[Tensor, Tensor | None]:  # fmt: skip
        """Parents after ``iterations`` rounds, and with ``keep_coefficients`` the coupling coefficients (B, P, N, J)
        of the last round (None at one round, which couples uniformly: the caller fills in 1/J)."""
        if iterations == 1:  # c_ij = 1/J: one product (conv: one conv2d), no vote tensor
            if self.kind == "conv":
                return routing.uniform_conv_step(u, self.weight, self.kernel_size, self.stride, routing.squash), None
            return self._grid(routing.uniform_step(self.group_children(u), self.weight, routing.squash), u), None
        parents, coefficients = routing.dynamic_routing(self.group_children(u), self.weight, iterations,
                                                        keep_coefficients)  # fmt: skip
        return self._grid(parents, u), coefficients

    def class_logits(self, parents: Tensor) -> Tensor:
        """(B, C, D) class capsules → (B, C) logits whose sigmoid is each capsule's length |v_k|."""
        length = torch.linalg.vector_norm(parents, dim=-1).clamp(self.MIN_LENGTH, 1 - self.LENGTH_EPS)  # (B, C)
        return torch.log(length) - torch.log1p(-length)  # logit(|v_k|)


# ------------------------------------------------------------------------------------- EM routing (Hinton et al. 2018)


class EMPrimaryCapsules(nn.Module):
    """Matrix capsules with activations (Hinton et al. 2018): a conv to types × D pose values and a conv to one
    activation logit per type, the paper's "logistic unit".

    Every EM capsule is packed as one vector of D + 1 values, the √D×√D pose (row-major) followed by the logit of its
    activation (activation = sigmoid of the last value), so that poses flow between layers as one tensor like the
    other routings' (see ``capserve.routing``'s EM section). ``layer_norm`` must be False: EM normalises nothing
    (``ModelConfig`` refuses True for EM).

    Shapes:
        features (B, C, H, W) → capsules (B, H', W', I, D + 1).
    """

    def __init__(self, in_channels: int, types: int, pose_dim: int, kernel: int, stride: int, padding: int,
                 layer_norm: bool = False):  # fmt: skip
        super().__init__()
        if layer_norm:
            raise ValueError("EM capsules take no LayerNorm: set layer_norm=False")
        self.types, self.pose_dim = types, pose_dim
        self.pose = nn.Conv2d(in_channels, types * pose_dim, kernel, stride=stride, padding=padding)
        self.activation = nn.Conv2d(in_channels, types, kernel, stride=stride, padding=padding)

    def forward(self, features: Tensor) -> Tensor:
        poses = self.pose(features)  # (B, I·D, H, W)
        B, _, H, W = poses.shape
        poses = poses.permute(0, 2, 3, 1).reshape(B, H, W, self.types, self.pose_dim)  # (B, H, W, I, D)
        logits = self.activation(features).permute(0, 2, 3, 1).unsqueeze(-1)  # (B, H, W, I, 1)
        return torch.cat([poses, logits], dim=-1)  # (B, H, W, I, D + 1)


class EMCapsuleLayer(nn.Module):
    """Parents routed from children by EM (Hinton et al. 2018); a conv capsule layer or a fully connected one.

    Conv: the parent at (h, w) routes the k×k window (stride s, no padding) over all child types, one 4×4 transform
    per (kh, kw, child type, parent type), shared over positions. FC from a grid (the paper's class capsules): one
    transform per (child type, parent type), shared over positions, with coordinate addition (each vote's scaled
    (row, column) centre added to the first two entries of its right-hand column). FC from an fc layer: one
    transform per (child, parent). β_v and β_a: learned, one per parent type.

    Args:
        config: kind, parent types J, kernel and stride.
        in_types: child capsule types I.
        in_size: side of the child grid (0 when the children come from an fc layer).
        pose: must be "matrix"; pose_dim D = X·X.
        layer_norm, activations: must be False (the EM capsule has its own activation; ``ModelConfig`` checks).
    Shapes:
        capsules carry D + 1 values (pose, activation logit; see ``EMPrimaryCapsules``).
        children: (B, H, W, I, D + 1) or (B, I, D + 1); parents: (B, h, w, J, D + 1) (conv) or (B, J, D + 1) (fc).
    """

    def __init__(self, config: CapsuleLayerConfig, in_types: int, in_size: int, pose: str, pose_dim: int,
                 layer_norm: bool = False, activations: bool = False):  # fmt: skip
        super().__init__()
        if pose != "matrix" or layer_norm or activations:
            raise ValueError("EM capsule layers need matrix poses, layer_norm=False and activations=False")
        self.kind, self.kernel_size, self.stride = config.kind, config.kernel_size, config.stride
        self.types = config.types
        X = math.isqrt(pose_dim)
        groups = config.kernel_size**2 * in_types if config.kind == "conv" else in_types
        children = groups * max(in_size, 1) ** 2 if config.kind == "fc" else groups  # N per parent position
        # std √N / X: 1/√X keeps each vote at its child's scale, and μ, the mean of N votes that disagree before
        # training, shrinks it by up to √N (less once the E-step concentrates the assignments). Measured on the
        # named configs, this keeps the poses' scale within 2× from layer to layer, where 1/√X shrinks it ~10×
        # per layer and leaves the class capsules' coordinate addition (of scale 1) drowning the poses.
        std = math.sqrt(children) / X
        self.weight = nn.Parameter(torch.randn(groups, config.types, X, X) * std)  # (G, J, X, X)
        self.beta_v = nn.Parameter(torch.zeros(config.types))  # (J,)
        self.beta_a = nn.Parameter(torch.zeros(config.types))  # (J,)
        offsets = routing.coordinate_offsets(in_size, in_types, pose_dim) if config.kind == "fc" and in_size else None
        self.register_buffer("offsets", offsets, persistent=False)  # (N, D) or None: derived, not saved

    def route(self, u: Tensor, iterations: int, keep_coefficients: bool = False) -> tuple[Tensor, Tensor | None]:
        """All ``iterations`` of EM for this layer: parents and, with ``keep_coefficients``, the assignment
        probabilities R (B, P, N, J) of the last M-step (uniform at one iteration)."""
        children = group_children(u, self.kind, self.kernel_size, self.stride)  # (B, P, N, D + 1)
        parents, coefficients = routing.em_route(
            children, self.weight, self.beta_v, self.beta_a, iterations, self.offsets, keep_coefficients
        )
        return parents_layout(parents, u, self.kind, self.kernel_size, self.stride), coefficients

    forward = route

    @staticmethod
    def class_logits(parents: Tensor) -> Tensor:
        """(B, C, D + 1) class capsules → (B, C) logits of their activations (the paper's class score)."""
        return parents[..., -1]
