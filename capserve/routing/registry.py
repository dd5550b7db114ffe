"""The routing algorithms side by side: one table from a config's ``routing_algorithm`` to what that algorithm brings
(its capsule layers, its loss, the schedules it runs), and the concurrent schedule's rule.

Everything that depends on the algorithm reads it here: the model builds its capsule layers and read-out from it
(``capserve.model.capsnet``), training takes its loss (``capserve.routing.losses``). The names are those of
``capserve.configs.ROUTING_ALGORITHMS``, which configs check without importing this table (configs are data).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor, nn

from capserve.routing.attention import CapsuleLayer, PrimaryCapsules, cross_entropy_loss
from capserve.routing.dynamic import DynamicCapsuleLayer, SquashedPrimaryCapsules, margin_loss
from capserve.routing.em import EMCapsuleLayer, EMPrimaryCapsules, spread_loss

# (logits (B, C), targets: (B,) class indices or (B, C) multi-hot, multi_label, progress through training in [0, 1])
Loss = Callable[[Tensor, Tensor, bool, float], Tensor]


@dataclass(frozen=True)
class Routing:
    """What one routing algorithm brings to a capsule network.

    Attributes:
        primary: the primary capsule layer, built as ``primary(in_channels, types, pose_dim, kernel, stride,
            padding, layer_norm)``.
        layer: the routed capsule layer, built as ``layer(spec, in_types, in_size, pose, pose_dim, layer_norm,
            activations)``; ``layer.route(children, iterations, keep_coefficients)`` runs all its iterations and
            returns (parents, coefficients (B, P, N, J) or None).
        loss: the training loss, as its paper trains it.
        schedules: the ``ModelConfig.routing`` values it runs. "concurrent" needs layers that also take one
            iteration at a time (``layer(children, parents)``); the comparison systems run all iterations of a layer
            before the next, as their papers do.
        linear_readout: the class capsules are read out by one linear head shared by every class (attention);
            otherwise the last layer scores them itself (``class_logits``: a length, an activation).
        votes_at_first_iteration: whether T = 1 builds every vote. Attention and dynamic routing start uniform and
            need only Σ_i v_ij (one product); EM's first M-step reads every vote.
    """

    primary: type[nn.Module]
    layer: type[nn.Module]
    loss: Loss
    schedules: tuple[str, ...]
    linear_readout: bool
    votes_at_first_iteration: bool


ROUTINGS: dict[str, Routing] = {
    "attention": Routing(
        primary=PrimaryCapsules,
        layer=CapsuleLayer,
        loss=cross_entropy_loss,
        schedules=("concurrent", "sequential"),
        linear_readout=True,
        votes_at_first_iteration=False,
    ),
    "dynamic": Routing(
        primary=SquashedPrimaryCapsules,
        layer=DynamicCapsuleLayer,
        loss=margin_loss,
        schedules=("sequential",),
        linear_readout=False,
        votes_at_first_iteration=False,
    ),
    "em": Routing(
        primary=EMPrimaryCapsules,
        layer=EMCapsuleLayer,
        loss=spread_loss,
        schedules=("sequential",),
        linear_readout=False,
        votes_at_first_iteration=True,
    ),
}


def update_is_read(layer: int, iteration: int, layers: int, iterations: int) -> bool:
    """Concurrent routing: whether layer ``layer`` (0-based, of ``layers`` routed layers) updated at iteration
    ``iteration`` (1-based) reaches the logits of a T = ``iterations`` run. Layer i's update at t is read by layer
    i+1 at t+1, so it reaches the output only if t <= T - (layers - 1 - i); later updates are skipped."""
    return iteration <= iterations - (layers - 1 - layer)
