"""The one door in: ``build_model(config)`` and ``load(dir)`` give a ``CapsNet`` or a baseline ``CNN``
(``capserve.create_model(name)`` is ``build_model(get_config(name))``)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from capserve.configs import ModelConfig
from capserve.errors import CheckpointError
from capserve.model.backbones import BACKBONES
from capserve.model.capsnet import CapsNet
from capserve.model.checkpoint import CONFIG, WEIGHTS, read_config
from capserve.model.cnn import CNN

Model = CapsNet | CNN  # what create_model and load return


def build_model(config: ModelConfig) -> Model:
    """The model ``config`` describes: a ``CapsNet``, or a baseline ``CNN`` for the heads "avgpool" and "fc"."""
    if config.backbone not in BACKBONES:
        raise ValueError(f"backbone must be one of {', '.join(BACKBONES)}, got {config.backbone!r}")
    return CapsNet(config) if config.has_routing else CNN(config)


def load(directory: str | Path, device: str | torch.device = "cpu") -> Model:
    """Load a model saved by ``model.save`` (a ``CapsNet`` or a baseline ``CNN``), in eval mode, on ``device``."""
    directory = Path(directory)
    config = read_config(directory)
    weights = directory / WEIGHTS
    if not weights.is_file():
        raise CheckpointError(f"{weights} not found next to {CONFIG}")
    try:
        state = load_file(str(weights))
    except (SafetensorError, OSError, RuntimeError) as e:
        raise CheckpointError(f"{weights} is not a readable safetensors file ({e}); is it truncated?") from e
    model = build_model(config)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise CheckpointError(f"{weights} does not match its config {config.name!r}: {e}") from e
    return model.to(device).eval()
