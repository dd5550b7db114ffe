"""Routing between capsule layers: the paper's inverted dot-product attention, and its two comparison systems,
dynamic routing and EM routing.

One module per algorithm, each with its maths, its capsule layers and its training loss: ``attention`` (the
paper's equations, read top to bottom, then the fast paths that give their numbers), ``dynamic``, ``em``.
``registry`` is the one table from a config's ``routing_algorithm`` to its layers, loss and schedules; ``blocks``
(bounded memory) and ``fused`` (the compiled CPU kernel) serve the fast paths; ``losses`` picks a config's loss.
"""

from __future__ import annotations

from capserve.routing.attention import (
    CapsuleLayer,
    PrimaryCapsules,
    agreement,
    cross_entropy_loss,
    reference_step,
    reference_uniform_step,
    routing_step,
    uniform_conv_step,
    uniform_step,
    votes,
)
from capserve.routing.dynamic import DynamicCapsuleLayer, SquashedPrimaryCapsules, dynamic_routing, margin_loss, squash
from capserve.routing.em import EMCapsuleLayer, EMPrimaryCapsules, em_route, em_routing, spread_loss
from capserve.routing.fused import without_fused_kernel
from capserve.routing.losses import training_loss
from capserve.routing.registry import ROUTINGS, Loss, Routing, update_is_read

__all__ = [
    "ROUTINGS",
    "CapsuleLayer",
    "DynamicCapsuleLayer",
    "EMCapsuleLayer",
    "EMPrimaryCapsules",
    "Loss",
    "PrimaryCapsules",
    "Routing",
    "SquashedPrimaryCapsules",
    "agreement",
    "cross_entropy_loss",
    "dynamic_routing",
    "em_route",
    "em_routing",
    "margin_loss",
    "reference_step",
    "reference_uniform_step",
    "routing_step",
    "spread_loss",
    "squash",
    "training_loss",
    "uniform_conv_step",
    "uniform_step",
    "update_is_read",
    "votes",
    "without_fused_kernel",
]
