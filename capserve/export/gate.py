"""The INT8 gate: an INT8 graph's decisions against its FP32 graph's on held-out images, the accuracy of both and
the points int8 loses, and, when it fails, what was measured and the likelier causes in that light (``diagnose``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from capserve.errors import ExportError
from capserve.runtime.base import Runtime
from capserve.runtime.metadata import ModelMetadata
from capserve.runtime.outputs import thresholds_or_default
from capserve.runtime.precision import AgreementReport, agreement, decisions

# Least top-1 (label-set) agreement of INT8 with FP32 on held-out images. One bound for both tasks: label-set
# agreement is the stricter measure, and this one keeps the accuracy lost to INT8 under a point on both shipped
# models while refusing a fully quantized multi-label model that loses more (docs/int8.md has the figures).
INT8_MIN_AGREEMENT = 0.97

# Most top-1 (exact match) accuracy int8 may lose on labelled held-out images, as a fraction (0.005: half a point).
# Agreement alone lets a loss of up to 1 - agreement through (3 points at 0.97), and the loss a user sees is what
# counts. One image is the finest loss a set of images can show, so the bound is never below one image's share.
INT8_MAX_ACCURACY_LOSS = 0.005


@dataclass(frozen=True)
class GateReport:
    """INT8 against FP32 on held-out images: agreement (``AgreementReport``) and the accuracy of both."""

    check: AgreementReport
    metric: str  # "top-1" or "exact match"
    fp32_accuracy: float | None  # None without labels
    int8_accuracy: float | None
    split: str
    max_loss: float = INT8_MAX_ACCURACY_LOSS  # of accuracy, as a fraction; checked when there are labels

    @property
    def lost(self) -> float | None:
        """Accuracy int8 loses against fp32 (a fraction; negative when it gains), None without labels."""
        if self.fp32_accuracy is None or self.int8_accuracy is None:
            return None
        return self.fp32_accuracy - self.int8_accuracy

    @property
    def loss_bound(self) -> float:
        """``max_loss``, but never below one held-out image's share (the finest loss the images can show)."""
        return max(self.max_loss, 1 / max(self.check.images, 1))

    @property
    def accuracy_passed(self) -> bool:
        lost = self.lost
        return lost is None or lost <= self.loss_bound + 1e-9  # accuracies are image counts over N: float noise only

    @property
    def passed(self) -> bool:
        return self.check.passed and self.accuracy_passed

    def __str__(self) -> str:
        c = self.check
        text = (
            f"int8 vs fp32 {c.measure} agreement {c.agreement:.4f} on {c.images} held-out images ({self.split}; "
            f"bound {c.bound:g}), max |Δlogit| {c.max_abs_logit:.3g}"
        )
        if self.lost is not None:
            text += (
                f"; {self.metric} fp32 {self.fp32_accuracy:.2%}, int8 {self.int8_accuracy:.2%}: "
                f"{100 * self.lost:.2f} points lost (bound {100 * self.loss_bound:.2f})"
            )
        return text


def accuracy(logits: np.ndarray, targets: np.ndarray, metadata: ModelMetadata) -> float:
    """Top-1 (single-label) or exact match with the model's thresholds (multi-label) of logits (N, C)."""
    chosen = decisions(logits, metadata)  # (N, 1) or (N, C)
    truth = targets[:, None] if metadata.task != "multi_label" else targets > 0.5  # (N, 1) or (N, C)
    return float((chosen == truth).all(axis=1).mean())


def score(
    fp32: Runtime,
    int8: Runtime,
    held_out: np.ndarray,
    targets: np.ndarray | None,
    split: str,
    bound: float = INT8_MIN_AGREEMENT,
    batch_size: int = 100,
    max_loss: float = INT8_MAX_ACCURACY_LOSS,
) -> GateReport:
    """The gate: two runtimes (``load_runtime`` of the FP32 and INT8 graphs) on held-out images (M, C, H, W)."""
    if not len(held_out):
        raise ExportError(
            "no held-out images to check the int8 graph on: give --calibration data with a test or "
            "val split, or more images than --calibration-images"
        )
    a = fp32.predict_in_batches(held_out, batch_size)  # (M, C)
    b = int8.predict_in_batches(held_out, batch_size)  # (M, C)
    return score_logits(a, b, fp32.metadata, targets, split, bound, max_loss)


def score_logits(
    fp32: np.ndarray,
    int8: np.ndarray,
    metadata: ModelMetadata,
    targets: np.ndarray | None,
    split: str,
    bound: float = INT8_MIN_AGREEMENT,
    max_loss: float = INT8_MAX_ACCURACY_LOSS,
) -> GateReport:
    """``score`` from the held-out images' logits (M, C) of both graphs (the export scores several int8 graphs
    against one fp32 run)."""
    check = AgreementReport(
        agreement=agreement(fp32, int8, metadata),
        images=len(fp32),
        bound=bound,
        measure="label set" if metadata.task == "multi_label" else "top-1",
        max_abs_logit=float(np.abs(int8.astype(np.float64) - fp32).max()),
        candidate="int8",
        sample="held-out images",
    )
    metric = "exact match" if metadata.task == "multi_label" else "top-1"
    if targets is None:
        return GateReport(check, metric, None, None, split, max_loss)
    return GateReport(
        check, metric, accuracy(fp32, targets, metadata), accuracy(int8, targets, metadata), split, max_loss
    )


def decision_margins(logits: np.ndarray, metadata: ModelMetadata) -> np.ndarray:
    """How far each image (logits (N, C)) is from another decision, in logits: top-1 minus the runner-up
    (single-label), or the distance of the logit nearest its threshold's logit (multi-label). (N,)"""
    if metadata.task != "multi_label":
        top = np.sort(logits.astype(np.float64), axis=1)
        return top[:, -1] - top[:, -2] if logits.shape[1] > 1 else np.full(len(logits), np.inf)
    t = np.clip(thresholds_or_default(metadata.thresholds, logits.shape[1]), 1e-12, 1 - 1e-12)
    return np.abs(logits.astype(np.float64) - np.log(t / (1 - t))).min(axis=1)


# Per-class agreements named in a refusal (the lowest first)
SHOWN_CLASSES = 3


def diagnose(
    held_out: tuple[np.ndarray, np.ndarray],
    calibration: tuple[np.ndarray, np.ndarray],
    metadata: ModelMetadata,
    bound: float,
    calibration_data: str,
    max_float_nodes: int,
) -> str:
    """Why an INT8 graph failed the gate, from the (fp32, int8) logits (N, C) of the held-out and of the calibration
    images: what was measured, then the likelier causes in the order the measurements point to.

    int8's error on its own calibration images is its rounding where the calibrated ranges fit; fp32's margins set
    against it tell a model that decides by near-ties (weakly trained: any rounding flips them, no calibration
    helps) from a quantization that is too coarse, and the calibration images' own agreement tells whether int8
    fails only on images unlike those it was calibrated on."""
    multi = metadata.task == "multi_label"
    fp32, int8 = held_out
    margins, same = decision_margins(fp32, metadata), _same_decision(fp32, int8, metadata)  # (N,), (N,)
    agreement, calibration_agreement = float(same.mean()), float(_same_decision(*calibration, metadata).mean())
    rounding = float(np.median(_logit_shift(*calibration)))
    reach = rounding * (1 if multi else 2)  # a flip of the top two moves both logits; a threshold decision one
    near = float((margins <= reach).mean())  # the held-out images int8's rounding alone can flip
    what = "the logit nearest its threshold" if multi else "top-1 minus runner-up logit"
    measured = (
        f"fp32's margins ({what}): median {np.median(margins):.3g} over the {len(margins)} held-out images"
        + (
            f", {np.median(margins[~same]):.3g} over the {int((~same).sum())} int8 decides otherwise"
            if (~same).any()
            else ""
        )
        + f"; on the calibration images int8 agrees on {calibration_agreement:.4f} and moves logits by "
        f"{rounding:.3g} (median of each image's max |Δlogit|; {np.median(_logit_shift(fp32, int8)):.3g} on the "
        f"held-out), within reach of another decision for {near:.0%} of the held-out images"
    )
    title, classes = _lowest_agreements(fp32, int8, same, metadata)
    causes = _likelier_causes(
        near,
        (agreement, calibration_agreement),
        bound,
        calibration_data,
        max_float_nodes,
        _logit_shift(fp32, int8).max(),
    )
    listed = "".join(f"\n  ({i}) {cause}" for i, cause in enumerate(causes, 1))
    return f"Measured: {measured}; {title}: {classes}.\nLikelier causes, in order:{listed}"


def _same_decision(a: np.ndarray, b: np.ndarray, metadata: ModelMetadata) -> np.ndarray:
    """(N,): whether logits ``a`` and ``b`` (N, C) decide the same."""
    return (decisions(a, metadata) == decisions(b, metadata)).all(axis=1)


def _logit_shift(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(N,): how far ``b`` (int8's logits, (N, C)) moves each image's logits from ``a``."""
    return np.abs(b.astype(np.float64) - a).max(axis=1)


def _lowest_agreements(
    fp32: np.ndarray, int8: np.ndarray, same: np.ndarray, metadata: ModelMetadata
) -> tuple[str, str]:
    """What the agreement is split by and its ``SHOWN_CLASSES`` lowest parts: per label (multi-label: that label's
    decision), else per class of fp32's answer (``same`` (N,): the images int8 decides as fp32)."""
    if metadata.task == "multi_label":
        per = (decisions(int8, metadata) == decisions(fp32, metadata)).mean(axis=0)  # (C,)
        counts = np.full(len(per), len(fp32))
        title = "agreement per label, lowest"
    else:
        answer = fp32.argmax(1)
        counts = np.bincount(answer, minlength=fp32.shape[1])
        per = np.array([same[answer == c].mean() if counts[c] else np.inf for c in range(fp32.shape[1])])
        title = "agreement per class of fp32's answer, lowest"
    order = [c for c in np.argsort(per, kind="stable") if np.isfinite(per[c])][:SHOWN_CLASSES]
    return title, ", ".join(f"{metadata.labels[c]} {per[c]:.2f} of {counts[c]}" for c in order)


def _likelier_causes(
    near: float,
    agreements: tuple[float, float],
    bound: float,
    calibration_data: str,
    max_float_nodes: int,
    max_shift: float,
) -> list[str]:
    """The three causes, the likelier first: a weakly trained model, calibration images unlike the held-out ones,
    layers too coarse in int8. ``near``: the share of held-out images within int8's rounding of another decision;
    ``agreements``: int8's on the held-out and on the calibration images; ``max_shift``: its largest |Δlogit|."""
    agreement, calibration_agreement = agreements
    weak = (
        f"the model decides by small margins (weakly trained?): {near:.0%} of the held-out images sit within "
        "int8's rounding of another decision, and no calibration changes that; train it further, or lower "
        "--min-agreement / pass --force if this fp32 model is the one to serve"
    )
    covered = calibration_agreement >= bound  # int8 holds on the images it was calibrated on
    if covered:
        unlike = (
            f"the calibration images ({calibration_data}) do not cover the held-out ones: int8 agrees with "
            f"fp32 on {calibration_agreement:.4f} of them but on {agreement:.4f} of the held-out; calibrate on "
            "images like the served ones, or on more of them (--calibration-images)"
        )
    else:
        unlike = (
            f"the calibration images ({calibration_data}) may not look like the served ones (the least "
            f"likely: int8 disagrees on them too); calibrate on images like the served ones, or on more of "
            "them (--calibration-images)"
        )
    coarse = (
        f"some layers lose too much to int8 (it moves logits by up to {max_shift:.3g}): leave "
        f"the most sensitive in float (--max-float-nodes, {max_float_nodes} this time; or --keep-float NODE), "
        "or try --calibration-method percentile"
    )
    if near >= 1 - bound:  # near-ties alone can account for failing the gate
        return [weak, *((unlike, coarse) if covered else (coarse, unlike))]
    return [unlike, coarse, weak] if covered else [coarse, unlike, weak]
