"""Logits → the answers the service gives (``/classify``, ``/multilabel``), one copy for every caller: the HTTP
service and ``capserve predict`` (``capserve.predict``), so that both answer exactly alike."""

from __future__ import annotations

import numpy as np

from capserve.pipeline.schemas import Classification, Label, MultiLabel
from capserve.runtime.metadata import ModelMetadata
from capserve.runtime.outputs import labels_passed, sigmoid, softmax, thresholds_or_default


def top_labels(
    probabilities: np.ndarray, labels: tuple[str, ...], k: int, passed: np.ndarray | None = None
) -> list[Label]:
    """The ``k`` most probable labels (of those ``passed``, a boolean mask, when given), most probable first."""
    order = np.argsort(-probabilities, kind="stable")
    if passed is not None:
        order = order[passed[order]]
    return [Label(label=labels[i], index=int(i), probability=float(probabilities[i])) for i in order[:k]]


def familiar(unfamiliarity: np.ndarray | None, count: int) -> list[dict[str, float | bool | None]]:
    """Each of ``count`` answers' ``unfamiliarity`` and ``unfamiliar`` fields; null without scores."""
    if unfamiliarity is None:
        return [{"unfamiliarity": None, "unfamiliar": None}] * count
    return [{"unfamiliarity": float(u), "unfamiliar": bool(u > 1)} for u in unfamiliarity]


def classifications(
    logits: np.ndarray, meta: ModelMetadata, top_k: int, unfamiliarity: np.ndarray | None = None
) -> list[Classification]:
    """Single-label answers for logits (B, C): the ``top_k`` labels by softmax probability, most probable first, and
    each image's ``unfamiliarity`` (B,) when there is one."""
    return [
        Classification(
            model=meta.name, iterations=meta.iterations, predictions=top_labels(p, meta.labels, top_k), **known
        )
        for p, known in zip(softmax(logits), familiar(unfamiliarity, len(logits)), strict=True)
    ]


def multilabel_answers(
    logits: np.ndarray, meta: ModelMetadata, threshold: float | None, unfamiliarity: np.ndarray | None = None
) -> list[MultiLabel]:
    """Multi-label answers for logits (B, C): every label at or above its threshold (``threshold`` for all labels
    when given, else the model's calibrated ones, else 0.5), with every probability and threshold, and each image's
    ``unfamiliarity`` (B,) when there is one."""
    if threshold is not None:
        thresholds = np.full(len(meta.labels), threshold, dtype=np.float64)
    else:
        thresholds = thresholds_or_default(meta.thresholds, len(meta.labels))
    answers = []
    for p, known in zip(sigmoid(logits), familiar(unfamiliarity, len(logits)), strict=True):  # (C,) per image
        answers.append(
            MultiLabel(
                **known,
                model=meta.name,
                iterations=meta.iterations,
                threshold=threshold,
                labels=top_labels(p, meta.labels, len(meta.labels), labels_passed(p, thresholds)),
                probabilities={name: float(v) for name, v in zip(meta.labels, p, strict=True)},
                thresholds={name: float(t) for name, t in zip(meta.labels, thresholds, strict=True)},
            )
        )
    return answers
