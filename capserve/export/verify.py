"""Parity of an exported artifact with eager PyTorch: the same images through both, per batch size (``compare``),
within tolerances that follow the artifact's precision (``DEFAULTS``); and the INT8 gate repeated on a file
(``verify_int8``). ``capserve verify`` (``capserve.export.cli``) prints them; docs/export.md explains the figures.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from capserve.data.images import IMAGE_SUFFIXES, ImageError, load_image
from capserve.data.preprocess import normalize_images
from capserve.errors import UsageError
from capserve.runtime.base import Runtime
from capserve.runtime.metadata import ModelMetadata
from capserve.runtime.outputs import probabilities
from capserve.runtime.precision import BF16_MIN_AGREEMENT, agreement

from .calibration import GATE_IMAGES, read_calibration
from .gate import INT8_MAX_ACCURACY_LOSS, score
from .int8 import fp32_graph, read_summary
from .onnx import load_checkpoint
from .quantize import runtime_for

log = logging.getLogger(__name__)

# precision → (atol, rtol, min agreement); FP16's matches capserve.export.fp16's documented tolerance; bf16's
# agreement bound is the service's start-up check, and its logit tolerance, loose for an 8-bit mantissa, catches
# only breakage such as overflow
DEFAULTS = {"fp32": (1e-4, 1e-4, 1.0), "fp16": (2e-2, 1e-1, 0.95), "bf16": (0.5, 0.1, BF16_MIN_AGREEMENT)}


@dataclass(frozen=True)
class Comparison:
    batch: int
    max_abs: float
    max_rel: float
    max_abs_prob: float
    agreement: float
    scale: float  # max |eager logit|

    def within(self, atol: float, rtol: float, min_agreement: float) -> bool:
        return self.max_abs <= atol + rtol * self.scale and self.agreement >= min_agreement


def load_images(folder: str | Path, metadata: ModelMetadata, count: int) -> np.ndarray:
    """``count`` normalised images (count, C, H, W) from a folder, cycled if few, preprocessed exactly as the service
    and training do (``capserve.data.images``: decode, orient, convert, centre square, resize, normalise)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UsageError(f"--images {folder} is not a folder")
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise UsageError(f"no images ({', '.join(sorted(IMAGE_SUFFIXES))}) in {folder}")
    arrays = []
    for path in files[:count]:
        try:
            arrays.append(load_image(path.read_bytes(), metadata))  # (C, H, W) uint8
        except (ImageError, OSError) as e:
            raise UsageError(f"cannot read image {path}: {e}") from e
    pixels = np.stack([arrays[i % len(arrays)] for i in range(count)])  # (count, C, H, W)
    return normalize_images(pixels, metadata)


def compare(reference: Runtime, artifact: Runtime, images: np.ndarray, batch_sizes: list[int]) -> list[Comparison]:
    """Run the first B images through both runtimes for each B."""
    meta = reference.metadata
    task = meta.task
    rows = []
    for B in batch_sizes:
        x = images[:B]
        ref, out = reference.predict(x), artifact.predict(x)
        diff = np.abs(out.astype(np.float64) - ref)
        scale = float(np.abs(ref).max())
        rows.append(
            Comparison(
                batch=B,
                max_abs=float(diff.max()),
                max_rel=float(diff.max() / max(scale, 1e-12)),
                scale=scale,
                max_abs_prob=float(np.abs(probabilities(out, task) - probabilities(ref, task)).max()),
                agreement=agreement(ref, out, meta),
            )
        )
    return rows


def verify_int8(
    artifact: str | Path,
    checkpoint: str | Path,
    data: str | Path | None = None,
    min_agreement: float | None = None,
    gate_images: int = GATE_IMAGES,
) -> int:
    """``capserve verify --int8``: the export's gate again, FP32 (from ``checkpoint``, at the file's T) against
    the INT8 file, on the held-out images of ``data`` (default: the calibration data the file records). Prints the
    report; returns 0 when it passes, 1 when not."""
    from capserve.runtime.onnx_backend import OnnxRuntime

    summary = read_summary(artifact)
    int8 = OnnxRuntime(artifact, int8_check=False)  # what it measures is printed, not refused
    model, digest = load_checkpoint(checkpoint)
    if int8.metadata.weights_sha256 != digest:
        log.warning("%s was exported from another weights file than %s", artifact, checkpoint)
    data = data or summary.calibration
    held = read_calibration(data, model.config, summary.calibration_images, gate_images)
    # the reference, named so in the log: verifying quantizes nothing
    fp32 = runtime_for(fp32_graph(checkpoint, model, digest, int8.metadata.iterations, use="as the reference"))
    bound = summary.bound if min_agreement is None else min_agreement
    max_loss = INT8_MAX_ACCURACY_LOSS if summary.max_accuracy_loss is None else summary.max_accuracy_loss
    report = score(fp32, int8, held.held_out, held.targets, held.split, bound, max_loss=max_loss)
    print(
        f"{artifact}: {int8.metadata.name}, int8 ({summary.target}, {summary.method} on "
        f"{summary.calibration_images} images of {summary.calibration}); fp32 reference {checkpoint}; data {data}"
    )
    print(report)
    print("passed" if report.passed else "FAILED: agreement below the bound")
    return 0 if report.passed else 1
