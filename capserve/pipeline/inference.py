"""Pixels -> logits (and each image's unfamiliarity), one step for the HTTP service's routes (adaptive batches
included) and ``Answerer``: the same checks, normalisation and batching of a large input for every caller."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from capserve.data.preprocess import normalize_images
from capserve.errors import InputError
from capserve.pipeline.errors import ErrorKind, RequestError
from capserve.runtime import Runtime

__all__ = ["Outputs", "logits_of", "outputs_of"]


@dataclass(frozen=True)
class Outputs:
    """What answers are made of, per image: logits (B, classes) and unfamiliarity (B,) (None: the model has no
    calibration, or the runtime no class capsules)."""

    logits: np.ndarray
    unfamiliarity: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.logits)

    def split(self, sizes: list[int]) -> list[Outputs]:
        """One ``Outputs`` per consecutive run of ``sizes`` images (adaptive batching hands each request its own)."""
        cuts = np.cumsum(sizes)[:-1]
        logits = np.split(self.logits, cuts)
        scores = np.split(self.unfamiliarity, cuts) if self.unfamiliarity is not None else [None] * len(logits)
        return [Outputs(part, score) for part, score in zip(logits, scores, strict=True)]


def outputs_of(runtime: Runtime, pixels: np.ndarray, batch_size: int | None = None) -> Outputs:
    """uint8 (B, C, H, W) → ``Outputs``: the logits, and the unfamiliarity where ``runtime`` carries a calibration
    (``Runtime.familiarity``) and gives class capsules; checked as ``logits_of``."""
    familiarity = runtime.familiarity
    if familiarity is None:
        return Outputs(logits_of(runtime, pixels, batch_size))
    x = _normalized(runtime, pixels)
    try:
        logits, poses = runtime.infer_in_batches(x, batch_size or max(len(x), 1))
    except InputError as e:
        raise RequestError(ErrorKind.BAD_INPUT, str(e)) from e
    return Outputs(logits, None if poses is None else familiarity.scores(poses))


def logits_of(runtime: Runtime, pixels: np.ndarray, batch_size: int | None = None) -> np.ndarray:
    """uint8 (B, C, H, W) → float32 logits (B, classes), ``batch_size`` images at a time (default all); bad
    pixels or shapes raise ``RequestError`` (``BAD_INPUT``)."""
    x = _normalized(runtime, pixels)
    try:
        return runtime.predict_in_batches(x, batch_size or max(len(x), 1))
    except InputError as e:
        raise RequestError(ErrorKind.BAD_INPUT, str(e)) from e


def _normalized(runtime: Runtime, pixels: np.ndarray) -> np.ndarray:
    """Checked uint8 pixels (B, C, H, W), normalised for ``runtime``'s model (``RequestError`` when bad)."""
    if pixels.dtype != np.uint8:  # JSON tensors arrive as int64
        if pixels.dtype.kind not in "iu" or pixels.size == 0 or pixels.min() < 0 or pixels.max() > 255:
            raise RequestError(
                ErrorKind.BAD_INPUT, f"images must be integer pixels in [0, 255], got {pixels.dtype} values"
            )
        pixels = pixels.astype(np.uint8)
    try:
        return normalize_images(pixels, runtime.metadata)
    except InputError as e:
        raise RequestError(ErrorKind.BAD_INPUT, str(e)) from e
