"""The capsule network: backbone → primary capsules → routed capsule layers → class capsules → logits."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from capserve.configs import CapsuleLayerConfig, ModelConfig
from capserve.model.backbones import BACKBONES
from capserve.model.checkpoint import save_model
from capserve.routing.registry import ROUTINGS, update_is_read


@dataclass(frozen=True)
class RoutingTrace:
    """What routing produced for one batch, for explanation.

    Attributes:
        logits: (B, C).
        poses: per capsule level, primary first: (B, H, W, I, D) on a grid or (B, I, D) after an fc layer.
        coefficients: per routed layer, the routing probabilities of the last iteration that reached the output,
            (B, P, N, J) with P the parent positions (h·w, or 1 for fc) and N the children of each position
            (k·k·I in (kh, kw, I) order for conv; all child capsules in (H, W, I) order for fc). Uniform (1/J)
            where that iteration was the first one.
        iterations: T used.
    """

    logits: Tensor
    poses: tuple[Tensor, ...]
    coefficients: tuple[Tensor, ...]
    iterations: int

    def part_whole(self) -> Tensor:
        """How strongly each capsule of the last grid layer routes to each class: (B, C, H, W, I).

        Read straight from the class layer's coefficients when its children lie on a grid; through fc capsule
        layers, the routing probabilities are chained (child → fc capsule → class), so each grid capsule's
        values over the classes still sum to 1.
        """
        return part_whole(self.poses, self.coefficients)


def part_whole(poses: tuple[Tensor, ...] | list[Tensor], coefficients: tuple[Tensor, ...] | list[Tensor]) -> Tensor:
    """See ``RoutingTrace.part_whole``; a function so that export can trace it into a graph."""
    i = len(coefficients) - 1
    flow = coefficients[i][:, 0]  # (B, N, C): the class layer has one position
    while poses[i].ndim == 3:  # the children of layer i are an fc layer's capsules
        i -= 1
        flow = torch.bmm(coefficients[i][:, 0], flow)  # (B, N_i, C)
    B, H, W, I = poses[i].shape[:4]
    return flow.reshape(B, H, W, I, -1).permute(0, 4, 1, 2, 3)  # (B, C, H, W, I)


class CapsNet(nn.Module):
    """Capsule network: inverted dot-product attention routing, or the config's comparison routing (``ROUTINGS``).

    Example:
        >>> model = capserve.create_model("cifar10-resnet")
        >>> model(torch.randn(8, 3, 32, 32), iterations=3).shape
        torch.Size([8, 10])
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        c = config
        self.backbone = BACKBONES[c.backbone](c)
        routing = ROUTINGS[c.routing_algorithm]
        self.primary = routing.primary(
            c.backbone_channels,
            c.primary_types,
            c.pose_dim,
            c.primary_kernel,
            c.primary_stride,
            c.primary_padding,
            c.layer_norm,
        )
        specs = (*c.capsules, CapsuleLayerConfig("fc", c.num_classes))
        sizes = (*c.spatial_sizes, *[0] * len(specs))  # grid side of each layer's children (0: no grid)
        in_types = (c.primary_types, *(s.types for s in specs[:-1]))
        # the class layer's options (attention's)
        shared = {"shared": True} if c.class_weights == "shared" else {}
        if c.class_grid is not None:
            shared["cells"] = c.class_grid
        if c.init_classes is not None:
            shared["init_types"] = c.init_classes
        if c.class_norm == "joint":
            shared["joint_norm"] = True
        self.capsules = nn.ModuleList(
            routing.layer(
                spec,
                in_types[i],
                sizes[i],
                c.pose,
                c.pose_dim,
                c.layer_norm,
                c.activations,
                **(shared if i == len(specs) - 1 else {}),
            )
            for i, spec in enumerate(specs)
        )
        # attention: one logit head shared by all class capsules; other routings read their class capsules out
        # themselves (length, activation), as ``class_logits`` of their last layer
        self.classifier = nn.Linear(c.pose_dim, 1) if routing.linear_readout else None

    def forward(self, x: Tensor, iterations: int | None = None) -> Tensor:
        """Logits (B, C) for images (B, C_in, H, W) after ``iterations`` routing iterations (default: config's)."""
        poses, _ = self.route(x, self.resolve_iterations(iterations), keep_coefficients=False)
        return self.logits_from(poses[-1])  # (B, C)

    @torch.no_grad()
    def trace(self, x: Tensor, iterations: int | None = None) -> RoutingTrace:
        """Logits together with every layer's poses and routing coefficients (see ``RoutingTrace``)."""
        T = self.resolve_iterations(iterations)
        poses, coefficients = self.route(x, T, keep_coefficients=True)
        return RoutingTrace(self.logits_from(poses[-1]), tuple(poses), tuple(coefficients), T)

    def logits_from(self, classes: Tensor) -> Tensor:
        """(B, C, D) class capsules (the last entry of ``route``'s poses) → (B, C) logits, whatever the read-out."""
        if self.classifier is None:
            return self.capsules[-1].class_logits(classes)
        return self.classifier(classes).squeeze(-1)

    def resolve_iterations(self, iterations: int | None) -> int:
        """The routing iterations a call runs: ``iterations``, or the config's when None."""
        T = self.config.iterations if iterations is None else iterations
        if not isinstance(T, int) or T < 1:
            raise ValueError(f"iterations must be an integer >= 1, got {iterations!r}")
        return T

    def route(self, x: Tensor, T: int, keep_coefficients: bool) -> tuple[list[Tensor], list[Tensor]]:
        """Every layer's poses for images (B, C_in, H, W) after T iterations of the config's schedule, and with
        ``keep_coefficients`` the routing coefficients of each routed layer (see ``RoutingTrace``).

        Returns:
            poses: primary first, then one per routed layer, the class capsules (B, C, D) last.
            coefficients: with ``keep_coefficients``, one (B, P, N, J) per routed layer (uniform 1/J where its last
                update that reaches the logits is the first iteration); without it, None per layer.
        """
        if x.ndim != 4 or x.shape[1] != self.config.in_channels:
            raise ValueError(f"expected images (B, {self.config.in_channels}, H, W), got {tuple(x.shape)}")
        poses = [self.primary(self.backbone(x))]  # (B, H, W, I, D)
        coefficients: list[Tensor | None] = []
        L = len(self.capsules)
        if self.config.routing == "sequential":
            # all T iterations of layer ℓ, with its children fixed, before layer ℓ+1 starts
            for layer in self.capsules:
                parents, c = layer.route(poses[-1], T, keep_coefficients)
                poses.append(parents)
                coefficients.append(c)
        else:
            # iteration 1: a forward pass with uniform routing
            for layer in self.capsules:
                parents, c = layer(poses[-1])
                poses.append(parents)
                coefficients.append(c)
            # iterations 2..T: every layer from the previous iteration's poses, all at once. Layer ℓ (1..L) at
            # iteration t reaches the output only if t <= T - (L - ℓ): later updates are never read, so skip them.
            for t in range(2, T + 1):
                previous = list(poses)
                for i, layer in enumerate(self.capsules):
                    if update_is_read(i, t, L, T):
                        poses[i + 1], coefficients[i] = layer(previous[i], previous[i + 1], keep_coefficients)
        if keep_coefficients:
            coefficients = [self._uniform(i, poses) if c is None else c for i, c in enumerate(coefficients)]
        return poses, coefficients  # type: ignore[return-value]

    def _uniform(self, i: int, poses: list[Tensor]) -> Tensor:
        layer = self.capsules[i]
        children = layer.group_children(poses[i])  # (B, P, N, D)
        B, P, N, _ = children.shape
        return children.new_full((B, P, N, layer.types), 1.0 / layer.types)

    def save(self, directory: str | Path) -> Path:
        """Write ``model.safetensors`` and ``config.json`` into ``directory`` (see ``capserve.load``)."""
        return save_model(self, directory)
