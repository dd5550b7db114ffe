"""Scores of logits against targets: top-k, per-class precision/recall/F1 and the confusion matrix (single-label);
exact match, per-class F1 and ranked recall (multi-label); and per-class threshold fitting."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from capserve.runtime.outputs import labels_passed, multi_label_decisions, sigmoid

THRESHOLD_GRID = tuple(round(0.05 * i, 2) for i in range(1, 20))  # 0.05 … 0.95


def single_label_metrics(logits: Tensor, targets: Tensor) -> dict[str, Any]:
    """Top-1, top-5 (top-k for fewer than 5 classes), per-class precision/recall/F1/support and the confusion
    matrix (rows: true, columns: predicted); a class never predicted (or never present) scores 0."""
    C = logits.shape[1]
    k = min(5, C)
    top = logits.topk(k, dim=1).indices  # (N, k)
    confusion = torch.bincount(targets * C + top[:, 0], minlength=C * C).view(C, C)  # (C, C)
    tp = confusion.diag().double()
    precision = tp / confusion.sum(0).clamp_min(1)
    recall = tp / confusion.sum(1).clamp_min(1)
    f1 = 2 * tp / (confusion.sum(0) + confusion.sum(1)).clamp_min(1)
    return {
        "top1": (top[:, 0] == targets).float().mean().item(),
        f"top{k}": (top == targets[:, None]).any(dim=1).float().mean().item(),
        "precision": precision.tolist(),
        "recall": recall.tolist(),
        "f1": f1.tolist(),
        "support": confusion.sum(1).tolist(),
        "macro_f1": f1.mean().item(),
        "confusion": confusion.tolist(),
    }


def multi_label_metrics(logits: Tensor, targets: Tensor, thresholds: tuple[float, ...] | None) -> dict[str, Any]:
    """Exact match (every class decided right) and per-class F1, with the server's decision rule
    (``capserve.runtime.outputs.multi_label_decisions``: probability at or above the threshold)."""
    pred = torch.from_numpy(multi_label_decisions(logits.numpy(), thresholds))  # (N, C)
    truth = targets > 0.5  # (N, C)
    f1 = _f1(pred, truth)
    return {
        "exact_match": (pred == truth).all(dim=1).float().mean().item(),
        "f1": f1.tolist(),
        "macro_f1": f1.mean().item(),
        "ranked_recall": ranked_recall(logits, truth),
    }


def ranked_recall(logits: Tensor, truth: Tensor) -> float:
    """Of each image's k labels, the share among its k highest logits, over all labels of all images (threshold-free:
    it shows whether a model ranks the right labels first before its activations cross any threshold)."""
    k = truth.sum(1, keepdim=True)  # (N, 1)
    rank = logits.argsort(dim=1, descending=True).argsort(dim=1)  # (N, C): 0 for the highest logit
    return ((rank < k) & truth).sum().item() / max(k.sum().item(), 1)


def _f1(pred: Tensor, truth: Tensor) -> Tensor:
    tp = (pred & truth).sum(0).float()
    fp = (pred & ~truth).sum(0).float()
    fn = (~pred & truth).sum(0).float()
    return 2 * tp / (2 * tp + fp + fn).clamp_min(1)  # (C,)


def fit_thresholds(logits: Tensor, targets: Tensor, grid: tuple[float, ...] = THRESHOLD_GRID) -> tuple[float, ...]:
    """Per class, the grid threshold with the best F1 on these (validation) logits; ties go to the value nearest 0.5.

    A class whose best F1 is no better than answering it for every image (what a low threshold does on a model that
    has not learnt it) keeps 0.5: calibration must not turn "no signal" into "always yes"."""
    probs, truth = sigmoid(logits.numpy()), targets > 0.5
    g = torch.tensor(grid, dtype=torch.float64)  # the stored values exactly: a tie scores as evaluation decides
    scores = torch.stack([_f1(torch.from_numpy(labels_passed(probs, float(t))), truth) for t in g])  # (G, C)
    always = _f1(torch.ones_like(truth), truth)  # (C,): the F1 of answering every label for every image
    best = []
    for c in range(scores.shape[1]):
        if scores[:, c].max() <= always[c] + 1e-9:
            best.append(0.5)
            continue
        top = scores[:, c] >= scores[:, c].max() - 1e-12
        candidates = g[top]
        best.append(round(float(candidates[(candidates - 0.5).abs().argmin()]), 4))
    return tuple(best)


PER_LABEL = ("precision", "recall", "f1", "support")  # per-class lists in the metrics, keyed by label in reports


def by_label(metrics: dict[str, Any], labels: Sequence[str]) -> dict[str, Any]:
    """The metrics with each per-class list as {label: value} (the order of ``labels``): a report read by a script
    must not depend on knowing the label order. The confusion matrix stays a matrix in the order of ``labels``."""
    return {k: dict(zip(labels, v, strict=True)) if k in PER_LABEL else v for k, v in metrics.items()}


def metrics(config: Any, logits: Tensor, targets: Tensor) -> dict[str, Any]:
    if config.task == "multi_label":
        return multi_label_metrics(logits, targets, config.thresholds)
    return single_label_metrics(logits, targets)
