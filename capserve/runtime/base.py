"""The one interface every runtime (eager torch, ONNX Runtime, TensorRT) offers to the service, CLI and tests."""

from __future__ import annotations

import dataclasses
import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np

from capserve.configs import ModelConfig


class RuntimeLoadError(ValueError):
    """An artifact that cannot be opened by a runtime: missing, corrupt, or built for another model or GPU."""


class InputError(ValueError):
    """A batch whose shape or dtype the runtime cannot accept; the message says what was expected."""


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
            name=config.name,
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
        if not isinstance(data, dict):
            raise RuntimeLoadError("model metadata must be a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise RuntimeLoadError(f"unknown model metadata keys {unknown}")
        missing = sorted({f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING} - data.keys())
        if missing:
            raise RuntimeLoadError(f"model metadata lacks {missing}")
        for key in ("labels", "mean", "std", "thresholds"):
            if data.get(key) is not None:
                data[key] = tuple(data[key])
        return cls(**data)

    @property
    def input_shape(self) -> tuple[int, int, int]:
        return (self.in_channels, self.image_size, self.image_size)


@dataclass(frozen=True)
class Explanation:
    """A prediction with the part-whole parse that routing produced (see ``RoutingTrace.part_whole``)."""

    logits: np.ndarray  # (B, C)
    part_whole: np.ndarray  # (B, C, H, W, I): how strongly each grid capsule routes to each class


class Runtime(ABC):
    """A loaded model: ``predict`` maps normalised float32 images (B, C, H, W) to logits (B, num_classes)."""

    metadata: ModelMetadata
    backend: str
    precision: str = "fp32"  # the arithmetic inference actually uses: fp32, fp16 (graph) or bf16 (torch autocast)
    precision_reason: str = ""  # why, when a server chose it (capserve.runtime.precision.open_torch)

    @property
    @abstractmethod
    def providers(self) -> list[str]:
        """Where inference actually runs, e.g. ["CPUExecutionProvider"] or ["cuda:0"]."""

    @abstractmethod
    def _predict(self, batch: np.ndarray) -> np.ndarray: ...

    def predict(self, batch: np.ndarray) -> np.ndarray:
        """Logits (B, C) as float32 for a checked batch of normalised images (B, C, H, W)."""
        return self._predict(self.check_batch(batch))

    def explain(self, batch: np.ndarray) -> Explanation:
        """Logits and part-whole parse; backends without routing outputs raise NotImplementedError."""
        raise NotImplementedError(f"the {self.backend} backend cannot explain this artifact")

    def check_batch(self, batch: np.ndarray) -> np.ndarray:
        if not isinstance(batch, np.ndarray):
            raise InputError(f"expected a numpy array, got {type(batch).__name__}")
        if batch.dtype != np.float32:
            raise InputError(f"expected float32 images, got {batch.dtype}; normalise with capserve.preprocess")
        if batch.ndim != 4 or batch.shape[1:] != self.metadata.input_shape or batch.shape[0] < 1:
            raise InputError(f"expected a batch of shape (B, {', '.join(map(str, self.metadata.input_shape))}) "
                             f"with B >= 1, got {batch.shape}")  # fmt: skip
        return np.ascontiguousarray(batch)
