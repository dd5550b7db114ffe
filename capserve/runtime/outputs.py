"""Logits → probabilities, one copy for every caller (service, precision checks): softmax for single-label
models, sigmoid per class for multi-label ones."""

from __future__ import annotations

import numpy as np


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
