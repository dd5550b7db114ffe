"""capserve: capsule networks with inverted dot-product attention routing: train, export, serve."""

from __future__ import annotations

from typing import Any

from capserve.checkpoint import CheckpointError, load, read_config
from capserve.configs import MODELS, CapsuleLayerConfig, ModelConfig, get_config, list_models
from capserve.model import CapsNet, RoutingTrace

__version__ = "0.1.0"


def create_model(name: str, **overrides: Any) -> CapsNet:
    """A freshly initialised model from a named configuration, with optional config field overrides.

    Example:
        >>> model = create_model("cifar10-resnet", iterations=3)
    """
    return CapsNet(get_config(name, **overrides))


__all__ = [
    "MODELS",
    "CapsNet",
    "CapsuleLayerConfig",
    "CheckpointError",
    "ModelConfig",
    "RoutingTrace",
    "__version__",
    "create_model",
    "get_config",
    "list_models",
    "load",
    "read_config",
]
