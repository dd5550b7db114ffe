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
