"""Pixels -> logits, one step for the HTTP service's routes (adaptive batches included) and ``Answerer``: the same
checks, normalisation and batching of a large input for every caller."""

from __future__ import annotations

import numpy as np

from capserve.data.preprocess import normalize_images
from capserve.errors import InputError
from capserve.pipeline.errors import ErrorKind, RequestError
from capserve.runtime import Runtime

__all__ = ["logits_of"]


def logits_of(runtime: Runtime, pixels: np.ndarray, batch_size: int | None = None) -> np.ndarray:
    """uint8 (B, C, H, W) → float32 logits (B, classes), ``batch_size`` images at a time (default all); bad
    pixels or shapes raise ``RequestError`` (``BAD_INPUT``)."""
    if pixels.dtype != np.uint8:  # JSON tensors arrive as int64
        if pixels.dtype.kind not in "iu" or pixels.size == 0 or pixels.min() < 0 or pixels.max() > 255:
            raise RequestError(
                ErrorKind.BAD_INPUT, f"images must be integer pixels in [0, 255], got {pixels.dtype} values"
            )
        pixels = pixels.astype(np.uint8)
    try:
        x = normalize_images(pixels, runtime.metadata)
        return runtime.predict_in_batches(x, batch_size or max(len(x), 1))
    except InputError as e:
        raise RequestError(ErrorKind.BAD_INPUT, str(e)) from e
