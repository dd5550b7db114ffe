"""Models: the capsule network (``capsnet``), the baseline CNNs (``cnn``), their backbones, and model directories
(``checkpoint``: ``model.safetensors`` + ``config.json``). ``factory`` is the door in: ``build_model``, ``load``."""

from __future__ import annotations

from capserve.model.backbones import BACKBONES
from capserve.model.capsnet import CapsNet, RoutingTrace, part_whole
from capserve.model.checkpoint import read_config, save_model
from capserve.model.cnn import CNN
from capserve.model.factory import Model, build_model, load

__all__ = [
    "BACKBONES",
    "CNN",
    "CapsNet",
    "Model",
    "RoutingTrace",
    "build_model",
    "load",
    "part_whole",
    "read_config",
    "save_model",
]
