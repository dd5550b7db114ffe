"""capserve: capsule networks with inverted dot-product attention routing: train, export, serve."""

from __future__ import annotations

from typing import Any

from capserve.configs import MODELS, CapsuleLayerConfig, ModelConfig, get_config, list_models
from capserve.errors import CheckpointError
from capserve.model.capsnet import CapsNet, RoutingTrace
from capserve.model.checkpoint import read_config
from capserve.model.cnn import CNN
from capserve.model.factory import Model, build_model, load

__version__ = "0.1.0"


def create_model(name: str, **overrides: Any) -> Model:
    """A freshly initialised model from a named configuration, with optional config field overrides: a ``CapsNet``,
    or a baseline ``CNN`` for configs with ``head="avgpool"`` or ``"fc"``.

    Example:
        >>> model = create_model("cifar10-resnet", iterations=3)
    """
    return build_model(get_config(name, **overrides))


__all__ = [
    "CNN",
    "MODELS",
    "CapsNet",
    "CapsuleLayerConfig",
    "CheckpointError",
    "Model",
    "ModelConfig",
    "RoutingTrace",
    "__version__",
    "create_model",
    "get_config",
    "list_models",
    "load",
    "read_config",
]
