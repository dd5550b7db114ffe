"""How unlike the images a model learned from an image is: its unfamiliarity score, the same on every runtime.

A capsule network's class capsules (B, C, D) say more about an image than the logits read from them. The score is
the squared Mahalanobis distance of an image's class capsules, flattened and scaled to unit length, to the nearest
class's mean among the training images' (single-label; multi-label images have one mean), under the covariance they
share, divided by ``threshold``: the distance that ``FAMILIAR_SHARE`` of the validation images stay within. Above 1
the image is unfamiliar. docs/unfamiliar.md has the measurements against the softmax probability and the energy
score on images the shipped models never saw.

``Familiarity`` is kept in the model folder as ``FAMILIARITY_FILE`` (safetensors: the means and the precision
matrix, the threshold in its metadata), written when a run trains (``capserve.train``) and by ``capserve
familiarity MODEL --data DATA`` for a folder that has none; it travels with the folder into BentoML's store, and
``capserve export onnx`` copies it beside a graph written elsewhere.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["FAMILIARITY_FILE", "FAMILIAR_SHARE", "Familiarity", "fit_familiarity", "read_familiarity"]

FAMILIARITY_FILE = "familiarity.safetensors"
FAMILIAR_SHARE = 0.95  # of the validation images, marked familiar by the threshold
RIDGE = 1e-6  # added to the covariance's diagonal: a direction no training image varies in stays invertible


@dataclass(frozen=True)
class Familiarity:
    """The training images' class capsules as the score reads them: ``means`` (K, F) (K = 1 for multi-label
    models), the shared ``precision`` (F, F), and the ``threshold`` of the squared distance; ``fitted`` says on
    what (for GET /model and the log)."""

    means: np.ndarray
    precision: np.ndarray
    threshold: float
    fitted: dict

    def distances(self, class_poses: np.ndarray) -> np.ndarray:
        """Squared Mahalanobis distance (B,) of class capsules (B, C, D) to the nearest mean."""
        z = _unit(class_poses)  # (B, F)
        d = z[:, None, :] - self.means[None]  # (B, K, F)
        return ((d @ self.precision) * d).sum(axis=-1).min(axis=1)  # (B,): one matrix product, in BLAS

    def scores(self, class_poses: np.ndarray) -> np.ndarray:
        """Unfamiliarity (B,): the distance over the threshold; above 1, unfamiliar."""
        return (self.distances(class_poses) / self.threshold).astype(np.float32)

    def save(self, folder: str | Path) -> Path:
        """Write ``FAMILIARITY_FILE`` into ``folder`` whole; returns its path."""
        from safetensors.numpy import save

        from capserve.files import write_whole

        path = Path(folder) / FAMILIARITY_FILE
        meta = {"threshold": repr(self.threshold), "fitted": json.dumps(self.fitted)}
        tensors = {"means": self.means.astype(np.float64), "precision": self.precision.astype(np.float64)}
        write_whole(path, save(tensors, metadata=meta))
        return path


def read_familiarity(folder: str | Path) -> Familiarity | None:
    """``FAMILIARITY_FILE`` in ``folder``; None when there is none. A damaged file raises ``ValueError``."""
    from safetensors import safe_open

    path = Path(folder) / FAMILIARITY_FILE
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), "np") as f:
            meta = f.metadata() or {}
            means, precision = f.get_tensor("means"), f.get_tensor("precision")
        threshold, fitted = float(meta["threshold"]), json.loads(meta.get("fitted", "{}"))
    except Exception as e:  # safetensors raises its own error types for a damaged file
        raise ValueError(f"{path} is not a familiarity file capserve wrote ({type(e).__name__}: {e})") from None
    if means.ndim != 2 or precision.shape != (means.shape[1],) * 2 or not threshold > 0:
        raise ValueError(f"{path}: means {means.shape}, precision {precision.shape}, threshold {threshold}")
    return Familiarity(means, precision, threshold, fitted)


def fit_familiarity(
    train_poses: np.ndarray, train_labels: np.ndarray | None, validation_poses: np.ndarray, **fitted: object
) -> Familiarity:
    """The familiarity of the images whose class capsules are ``train_poses`` (N, C, D): one mean per label in
    ``train_labels`` (N,) (None: one mean, for multi-label models), their shared covariance, and the threshold that
    ``FAMILIAR_SHARE`` of ``validation_poses`` (M, C, D) stay within. ``fitted`` is recorded with it."""
    z = _unit(train_poses)  # (N, F)
    labels = np.zeros(len(z), np.int64) if train_labels is None else np.asarray(train_labels)
    classes = np.unique(labels)
    means = np.stack([z[labels == k].mean(axis=0) for k in classes])  # (K, F)
    centred = z - means[np.searchsorted(classes, labels)]  # (N, F)
    covariance = centred.T @ centred / len(z) + RIDGE * np.eye(z.shape[1])
    precision = np.linalg.pinv(covariance)  # (F, F)
    partial = Familiarity(means, precision, 1.0, {})
    threshold = float(np.quantile(partial.distances(validation_poses), FAMILIAR_SHARE))
    record = {"train_images": len(z), "validation_images": len(validation_poses), "familiar_share": FAMILIAR_SHARE}
    return Familiarity(means, precision, max(threshold, 1e-12), {**record, **fitted})


def _unit(class_poses: np.ndarray) -> np.ndarray:
    """Class capsules (B, C, D) → (B, C·D) float64 of unit length."""
    z = class_poses.reshape(len(class_poses), -1).astype(np.float64)
    return z / np.maximum(np.linalg.norm(z, axis=1, keepdims=True), 1e-12)
