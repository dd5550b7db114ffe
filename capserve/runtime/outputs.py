"""Logits → probabilities, one copy for every caller (service, precision checks): softmax for single-label
models, sigmoid per class for multi-label ones; the multi-label decision rule; and the answer's options (``top_k``,
``threshold``) checked once for the service and ``capserve predict``."""

from __future__ import annotations

import numpy as np

__all__ = [
    "DEFAULT_TOP_K",
    "answer_options",
    "labels_passed",
    "multi_label_decisions",
    "probabilities",
    "sigmoid",
    "softmax",
    "thresholds_or_default",
]

DEFAULT_TOP_K = 5  # labels in a single-label answer when the caller names no number (fewer when the model has fewer)


def softmax(logits: np.ndarray) -> np.ndarray:
    """Softmax over the last axis, (…, C) → (…, C), the max subtracted first."""
    z = logits - logits.max(axis=-1, keepdims=True)  # (B, C)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def sigmoid(logits: np.ndarray) -> np.ndarray:
    """Per-class sigmoid, any shape."""
    return 1.0 / (1.0 + np.exp(-logits))


def probabilities(logits: np.ndarray, task: str) -> np.ndarray:
    """Softmax over classes, or per-class sigmoid for multi-label models: (B, C) → (B, C)."""
    return sigmoid(logits) if task == "multi_label" else softmax(logits)


def thresholds_or_default(thresholds: tuple[float, ...] | list[float] | None, classes: int) -> np.ndarray:
    """A multi-label model's per-class thresholds, 0.5 each where it stores none: (C,) float64."""
    return np.asarray(thresholds if thresholds is not None else [0.5] * classes, dtype=np.float64)


def labels_passed(probabilities: np.ndarray, thresholds: np.ndarray | float) -> np.ndarray:
    """The multi-label decision, the one rule of every caller (server, ``capserve evaluate``, training's figures,
    export checks): a label is answered when its probability is **at or above** its threshold. (…, C) → bool (…, C).

    The probabilities are compared in float64, so a threshold equal to a probability the server returned (a float32
    written to JSON and read back) passes that label.
    """
    return np.asarray(probabilities, dtype=np.float64) >= thresholds


def multi_label_decisions(logits: np.ndarray, thresholds: tuple[float, ...] | list[float] | None) -> np.ndarray:
    """Logits (B, C) → which labels are answered, bool (B, C): ``labels_passed`` on the per-class sigmoid."""
    logits = np.asarray(logits, dtype=np.float32)
    return labels_passed(sigmoid(logits), thresholds_or_default(thresholds, logits.shape[-1]))


def answer_options(
    labels: int, top_k: int | None = None, threshold: float | None = None, multi_label: bool = False
) -> tuple[int, float | None]:
    """The options of an answer, checked in one place for the service (``/classify``, ``/classify_batch``,
    ``/multilabel``) and ``capserve predict`` (``Predictor``): (top_k, threshold) to answer with.

    ``top_k``: labels in a single-label answer, 1..``labels``; None: up to ``DEFAULT_TOP_K``, never more than the
    model has. A multi-label answer holds every label past its threshold, so ``top_k`` plays no part in it and is
    not checked (``multi_label``). ``threshold``: one threshold for every label, in (0, 1); None: the model's own.
    Raises ``ValueError`` with the words the service answers a bad request with (400).

    Example:
        >>> answer_options(3)
        (3, None)
        >>> answer_options(10, top_k=2, threshold=0.3)
        (2, 0.3)
    """
    if threshold is not None and not 0 < threshold < 1:
        raise ValueError(f"threshold must be in (0, 1), got {threshold}")
    if top_k is None or multi_label:
        return min(DEFAULT_TOP_K, labels), threshold
    if not 1 <= top_k <= labels:
        raise ValueError(f"top_k={top_k} but the model has {labels} labels: give 1..{labels}")
    return top_k, threshold
