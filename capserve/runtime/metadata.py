"""What an exported artifact says about itself: ``ModelMetadata`` (labels, input spec, iterations, precision),
stored as JSON under these keys in ONNX files' metadata and in engine sidecars. Written by ``capserve.export``,
read by the runtimes, checked against known keys (never evaluated).
"""

from __future__ import annotations

import base64
import dataclasses
import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from capserve.configs import ModelConfig
from capserve.errors import RuntimeLoadError
from capserve.records import checked_fields

# written by capserve.export.onnx (kept here so that serving never imports the exporter)
METADATA_KEY = "capserve.metadata"


PRECISION_KEY = "capserve.precision"


CONFIG_KEY = "capserve.config"  # the architecture (ModelConfig JSON): sizes the chunks of a large batch


# written by capserve.export.int8: the inputs an int8 graph re-checks on the machine that opens it (Int8Check JSON)
INT8_CHECK_KEY = "capserve.int8_check"


LOGITS, PART_WHOLE = "logits", "part_whole"


# a capsule network's class capsules (B, C, D), beside the logits: what its unfamiliarity score reads
# (capserve.runtime.familiarity)
CLASS_POSES = "class_poses"


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


@dataclass(frozen=True)
class Int8Check:
    """What an INT8 graph re-checks when a runtime opens it: calibration images on which int8 decided as fp32 on
    the machine that exported it, their fp32 logits and that machine's int8 logits, and the export gate's bound
    (``capserve.runtime.onnx_backend.check_int8``; docs/int8.md, "Where it is served")."""

    pixels: str  # base64 of the images, uint8 (N, C, H, W) before normalisation: exact, and a quarter of float32
    shape: tuple[int, int, int, int]  # (N, C, H, W)
    fp32_logits: tuple[tuple[float, ...], ...]  # (N, classes)
    int8_logits: tuple[tuple[float, ...], ...]  # (N, classes), on the exporting machine
    bound: float  # least agreement with the fp32 decisions: the export gate's
    cpu: str  # the exporting machine's processor (``CpuInfo.describe()``)

    @classmethod
    def build(
        cls, pixels: np.ndarray, fp32_logits: np.ndarray, int8_logits: np.ndarray, bound: float, cpu: str
    ) -> Int8Check:
        """From uint8 images (N, C, H, W) and logits (N, classes)."""
        return cls(
            pixels=base64.b64encode(np.ascontiguousarray(pixels, np.uint8).tobytes()).decode("ascii"),
            shape=tuple(int(n) for n in pixels.shape),  # type: ignore[arg-type]
            fp32_logits=tuple(tuple(float(v) for v in row) for row in fp32_logits),
            int8_logits=tuple(tuple(float(v) for v in row) for row in int8_logits),
            bound=float(bound),
            cpu=cpu,
        )

    def images(self) -> np.ndarray:
        """The recorded images, uint8 (N, C, H, W)."""
        return np.frombuffer(base64.b64decode(self.pixels), np.uint8).reshape(self.shape).copy()

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Int8Check:
        """Parse the record, accepting only known keys; ``RuntimeLoadError`` for anything else."""
        try:
            data = checked_fields(cls, json.loads(text), "int8 check")
            check = cls(
                **{
                    **data,
                    "shape": tuple(data["shape"]),
                    "fp32_logits": tuple(tuple(r) for r in data["fp32_logits"]),
                    "int8_logits": tuple(tuple(r) for r in data["int8_logits"]),
                }
            )
            count = check.images().shape[0]
        except (ValueError, TypeError) as e:  # JSONDecodeError and binascii.Error are ValueErrors
            raise RuntimeLoadError(f"{INT8_CHECK_KEY!r} is not a capserve int8 check ({e})") from e
        if not count or len(check.fp32_logits) != count or len(check.int8_logits) != count:
            raise RuntimeLoadError(f"{INT8_CHECK_KEY!r} holds {count} images but logits for another number")
        return check
