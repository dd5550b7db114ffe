"""Model directories: ``model.safetensors`` (weights) + ``config.json`` (everything else). No pickle."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from safetensors.torch import save_file
from torch import Tensor, nn

from capserve.configs import ModelConfig
from capserve.errors import CheckpointError
from capserve.files import partial_file, write_whole
from capserve.hashing import file_sha256  # re-exported: the weights' digest

__all__ = [
    "CONFIG",
    "FORMAT_VERSION",
    "NOT_LEARNED",
    "WEIGHTS",
    "file_sha256",
    "not_learned_warning",
    "read_config",
    "read_extra",
    "save_model",
    "save_tensors",
    "update_config",
]

log = logging.getLogger(__name__)
WEIGHTS = "model.safetensors"
CONFIG = "config.json"
FORMAT_VERSION = 1
NOT_LEARNED = "learned"  # the key under config.json's "training" that a run which did not beat the prior sets false


def save_model(model: nn.Module, directory: str | Path, extra: dict[str, Any] | None = None) -> Path:
    """Save a model's weights and its ``model.config`` to ``directory`` (created if needed) and return it.

    Each file is written beside its place and renamed over it, so a process killed while saving leaves each file
    whole, old or new; ``replacing_directory`` makes the pair change together."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    with partial_file(directory / WEIGHTS) as partial:
        save_tensors(state, partial, metadata={"format": "pt"})
    _write_payload(directory, model.config, extra or {})
    return directory


def _write_payload(directory: Path, config: ModelConfig, extra: dict[str, Any]) -> None:
    """The one writer of ``config.json``: whole or not at all (``write_whole``), so that a full disk or a kill
    mid-write leaves the old file loadable."""
    payload = {"format_version": FORMAT_VERSION, "config": config.to_dict(), **extra}
    write_whole(directory / CONFIG, json.dumps(payload, indent=2) + "\n")


def _read_payload(directory: str | Path) -> dict[str, Any]:
    """The one reader of ``config.json``: its whole JSON object (``CheckpointError`` when it is missing or no
    capserve config)."""
    path = Path(directory) / CONFIG
    if not path.is_file():
        raise CheckpointError(
            f"{path} not found: a model directory holds {CONFIG} and {WEIGHTS} "
            "(written by model.save(dir) or `capserve train`)"
        )
    try:
        payload = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not a valid capserve config: {e}") from e
    if not isinstance(payload, dict):
        raise CheckpointError(f"{path} is not a valid capserve config: not a JSON object")
    if payload.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: format_version {payload.get('format_version')!r} is not "
            f"{FORMAT_VERSION}; re-save it with this capserve version"
        )
    return payload


def read_extra(directory: str | Path) -> dict[str, Any]:
    """What a model directory's ``config.json`` records beside the model config: ``training`` (the run's recipe
    and counters), ``metrics`` and the like."""
    return {k: v for k, v in _read_payload(directory).items() if k not in ("format_version", "config")}


def update_config(
    directory: str | Path, config: ModelConfig | None = None, training: dict[str, Any] | None = None
) -> None:
    """Rewrite a model directory's ``config.json`` (its weights untouched): ``config`` in place of its model config
    (e.g. calibrated thresholds), ``training``'s entries merged into its ``training`` record; every other entry
    kept."""
    directory = Path(directory)
    extra = read_extra(directory)
    if training:
        extra["training"] = {**(extra.get("training") or {}), **training}
    _write_payload(directory, config if config is not None else read_config(directory), extra)


def save_tensors(tensors: dict[str, Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """``safetensors``' ``save_file`` with the permissions of any other new file (0644 under the usual umask):
    it writes mode 0600, which would leave a model folder copied to a server or a shared disk with weights only its
    author can read."""
    save_file(tensors, str(path), metadata=metadata)
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def read_config(directory: str | Path) -> ModelConfig:
    """The ``ModelConfig`` stored in a model directory."""
    payload = _read_payload(directory)
    try:
        return ModelConfig.from_dict(payload["config"])
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{Path(directory) / CONFIG} is not a valid capserve config: {e}") from e


def not_learned_warning(directory: str | Path) -> str | None:
    """A warning for a model folder whose training run did not beat the label prior (``"training": {"learned":
    false}`` in its config.json, written by ``capserve train``); None for any other folder."""
    try:
        training = read_extra(directory).get("training") or {}
    except (OSError, CheckpointError):
        return None
    if not isinstance(training, dict) or training.get(NOT_LEARNED) is not False:
        return None
    best, prior = training.get("best_val"), training.get("prior_val")
    figures = f" (best validation {100 * best:.1f} %, label prior {100 * prior:.1f} %)" if best is not None else ""
    return (
        f"{directory} did not learn{figures}: its answers are no better than always giving the most common "
        "label; retrain it (see `capserve train`'s log) before serving or exporting it"
    )
