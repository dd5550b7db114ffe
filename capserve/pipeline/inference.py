"""Pixels -> logits -> answers, one copy for the HTTP service's routes and ``capserve predict``'s ``Predictor``:
the same checks, normalisation, batching of a large input and answers for both."""

from __future__ import annotations

import numpy as np

from capserve.data.preprocess import normalize_images
from capserve.errors import InputError
from capserve.pipeline.answers import classifications, multilabel_answers
from capserve.pipeline.decoding import RequestError
from capserve.pipeline.schemas import Classification, MultiLabel
from capserve.runtime import Runtime


def logits_of(runtime: Runtime, pixels: np.ndarray, batch_size: int | None = None) -> np.ndarray:
    """uint8 (B, C, H, W) → float32 logits (B, classes), ``batch_size`` images at a time (default all); bad
    pixels or shapes raise ``RequestError`` (400)."""
    if pixels.dtype != np.uint8:  # JSON tensors arrive as int64
        if pixels.dtype.kind not in "iu" or pixels.size == 0 or pixels.min() < 0 or pixels.max() > 255:
            raise RequestError(400, f"images must be integer pixels in [0, 255], got {pixels.dtype} values")
        pixels = pixels.astype(np.uint8)
    try:
        x = normalize_images(pixels, runtime.metadata)
        return runtime.predict_in_batches(x, batch_size or max(len(x), 1))
    except InputError as e:
        raise RequestError(400, str(e)) from e


def answers_of(
    runtime: Runtime, pixels: np.ndarray, top_k: int, threshold: float | None
) -> list[Classification] | list[MultiLabel]:
    """uint8 (B, C, H, W) → the answers ``/classify`` (a single-label model: ``top_k`` labels) or ``/multilabel``
    (a multi-label model: ``threshold``, None for the model's own) give, one per image."""
    meta = runtime.metadata
    logits = logits_of(runtime, pixels)
    if meta.task == "multi_label":
        return multilabel_answers(logits, meta, threshold)
    return classifications(logits, meta, top_k)
