"""Model directories: ``model.safetensors`` (weights) + ``config.json`` (everything else). No pickle."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from capserve.configs import ModelConfig
from capserve.model import Model, build_model

log = logging.getLogger(__name__)

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A model directory that cannot be loaded; the message says what is wrong and how to fix it."""


def file_sha256(path: str | Path) -> str:
    """SHA-256 of a file (e.g. a checkpoint's weights: what exported artifacts record as their source)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def save_model(model: Model, directory: str | Path, extra: dict[str, Any] | None = None) -> Path:
    """Save weights and config to ``directory`` (created if needed) and return it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(state, str(directory / WEIGHTS), metadata={"format": "pt"})
    payload = {"format_version": FORMAT_VERSION, "config": model.config.to_dict(), **(extra or {})}
    (directory / CONFIG).write_text(json.dumps(payload, indent=2) + "\n")
    return directory


def read_config(directory: str | Path) -> ModelConfig:
    """The ``ModelConfig`` stored in a model directory."""
    path = Path(directory) / CONFIG
    if not path.is_file():
        raise CheckpointError(f"{path} not found: a model directory holds {CONFIG} and {WEIGHTS} "
                              "(written by model.save(dir) or `capserve train`)")  # fmt: skip
    try:
        payload = json.loads(path.read_text())
        if payload.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(f"{path}: format_version {payload.get('format_version')!r} is not "
                                  f"{FORMAT_VERSION}; re-save it with this capserve version")  # fmt: skip
        return ModelConfig.from_dict(payload["config"])
    except CheckpointError:
        raise
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{path} is not a valid capserve config: {e}") from e


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
