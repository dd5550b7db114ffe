"""What an exported artifact says about itself: ``ModelMetadata`` (labels, input spec, iterations, precision),
stored as JSON under these keys in ONNX files' metadata and in engine sidecars. Written by ``capserve.export``,
read by the runtimes, checked against known keys (never evaluated).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from capserve.configs import ModelConfig
from capserve.errors import RuntimeLoadError
from capserve.records import checked_fields

# written by capserve.export.onnx (kept here so that serving never imports the exporter)
METADATA_KEY = "capserve.metadata"


PRECISION_KEY = "capserve.precision"


CONFIG_KEY = "capserve.config"  # the architecture (ModelConfig JSON): sizes the chunks of a large batch


LOGITS, PART_WHOLE = "logits", "part_whole"


@dataclass(frozen=True)
class ModelMetadata:
    """What a served artifact must say about itself; stored as JSON inside ONNX files and engine sidecars."""

    name: str
    task: str
    labels: tuple[str, ...]
    in_channels: int
    image_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    iterations: int | None  # routing iterations T; None: the model has no routing (a baseline CNN)
    thresholds: tuple[float, ...] | None = None
    capserve_version: str = ""
    weights_sha256: str = ""

    @classmethod
    def from_config(cls, config: ModelConfig, iterations: int | None = None, **extra: str) -> ModelMetadata:
        return cls(
            name=str(config.extra.get("name") or config.name),  # a trained run's name (``capserve train --name``)
            task=config.task,
            labels=tuple(config.labels),
            in_channels=config.in_channels,
            image_size=config.image_size,
            mean=tuple(config.mean),
            std=tuple(config.std),
            iterations=None if not config.has_routing else config.iterations if iterations is None else iterations,
            thresholds=config.thresholds,
            **extra,
        )

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ModelMetadata:
        """Parse metadata JSON, accepting only known keys (never evaluated, never set blindly)."""
        try:
            data: dict[str, Any] = json.loads(text)
        except json.JSONDecodeError as e:
            raise RuntimeLoadError(f"model metadata is not valid JSON: {e}") from e
        try:
            checked_fields(cls, data, "model metadata")
        except ValueError as e:
            raise RuntimeLoadError(str(e)) from e
        for key in ("labels", "mean", "std", "thresholds"):
            if data.get(key) is not None:
                data[key] = tuple(data[key])
        return cls(**data)

    @property
    def input_shape(self) -> tuple[int, int, int]:
        return (self.in_channels, self.image_size, self.image_size)
