"""Models: the capsule network (``capsnet``), the baseline CNNs (``cnn``), their backbones, and model directories
(``checkpoint``: ``model.safetensors`` + ``config.json``). ``factory`` is the door in: ``build_model``, ``load``."""

from __future__ import annotations

from capserve.model.backbones import BACKBONES, BasicBlock, resnet18_backbone, resnet_backbone, simple_backbone  # noqa: F401
from capserve.model.capsnet import CAPSULE_LAYERS, PRIMARY_CAPSULES, CapsNet, RoutingTrace, part_whole  # noqa: F401
from capserve.model.checkpoint import CONFIG, FORMAT_VERSION, WEIGHTS, file_sha256, read_config, save_model  # noqa: F401
from capserve.model.cnn import CNN, conv_bn_relu  # noqa: F401
from capserve.model.factory import Model, build_model, load  # noqa: F401
