"""Evaluation: a checkpoint's metrics on a split per routing iteration count (``capserve evaluate``), the metrics
themselves, threshold calibration and the figures of runs and evaluations."""

from capserve.evaluate.evaluator import calibrate, evaluate, evaluate_own, predict_batches, predict_logits
from capserve.evaluate.metrics import fit_thresholds, multi_label_metrics, single_label_metrics

__all__ = [
    "calibrate",
    "evaluate",
    "evaluate_own",
    "fit_thresholds",
    "multi_label_metrics",
    "predict_batches",
    "predict_logits",
    "single_label_metrics",
]
