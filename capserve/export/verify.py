"""``capserve verify ARTIFACT --against CHECKPOINT``: the same inputs through eager PyTorch and an artifact.

``capserve verify MODEL_DIR --precision bf16`` compares the model folder under bf16 autocast with itself in fp32:
the check the service runs at start-up before serving bf16 (``capserve.runtime.precision``: 64 seeded images,
decisions agree on at least 0.9 of them).

Per batch size it prints the max abs and relative difference of the logits (relative: max |Δ| / max |eager|),
the max abs difference of the probabilities (softmax, or sigmoid for multi-label models) and the top-1
agreement. It exits 1 when a tolerance is exceeded: logits need max |Δ| <= atol + rtol · max |eager| and the
top-1 agreement at least ``--min-agreement``. Defaults follow the artifact's precision (FP32 / FP16 graph, bf16).
Agreement means the same decision per image: top-1 for single-label models, the whole set of labels past their
thresholds for multi-label ones.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from capserve.data.images import IMAGE_SUFFIXES, ImageError, load_image
from capserve.data.preprocess import normalize_images
from capserve.errors import UsageError
from capserve.runtime import BACKENDS, Runtime, infer_backend, load_runtime
from capserve.runtime.metadata import ModelMetadata
from capserve.runtime.outputs import probabilities
from capserve.runtime.precision import (
    MIN_AGREEMENT,
    PRECISIONS,
    SAMPLE_SIZE,
    agreement,
    decisions,  # noqa: F401  (importable from here, as before it moved)
    resolve_precision,
    sample_images,
)

# precision → (atol, rtol, min agreement); FP16's matches capserve.export.fp16's documented tolerance; bf16's
# agreement bound is the service's start-up check, its logit tolerance is loose (8-bit mantissa: measured 0.07-0.18
# on the shipped models) and catches only breakage such as overflow
DEFAULTS = {"fp32": (1e-4, 1e-4, 1.0), "fp16": (2e-2, 1e-1, 0.95), "bf16": (0.5, 0.1, MIN_AGREEMENT)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("artifact", help=".onnx file, TensorRT engine (.plan) or model directory")
    parser.add_argument(
        "--against",
        help="the checkpoint (model directory) it was exported from (default: the "
        "artifact, when it is a model directory)",
    )
    parser.add_argument("--images", help="folder of images to use (default: seeded random images)")
    parser.add_argument(
        "--batch-sizes", help=f"comma-separated (default 1,7,64; {SAMPLE_SIZE} at bf16: the service's start-up check)"
    )
    parser.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="fp32",
        help="torch backend (a model directory): fp32, bf16 autocast, or auto (bf16 where the CPU "
        "has native bf16) (default %(default)s)",
    )
    parser.add_argument("--backend", choices=list(BACKENDS), help="default: from the artifact's file name")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default %(default)s)")
    parser.add_argument("--atol", type=float, help="logit tolerance (default 1e-4 FP32, 2e-2 FP16)")
    parser.add_argument("--rtol", type=float, help="logit tolerance per unit of max |logit| (1e-4 FP32, 0.1 FP16)")
    parser.add_argument("--min-agreement", type=float, help="least top-1 agreement (default 1.0 FP32, 0.95 FP16)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random images (default %(default)s)")
    parser.add_argument(
        "--int8",
        action="store_true",
        help="an INT8 export: repeat its gate (agreement and accuracy on held-out images of --data)",
    )
    parser.add_argument("--data", help="--int8: the images to hold out (default: the calibration data it records)")


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


def parse_batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError as e:
        raise UsageError(f"--batch-sizes must be comma-separated integers like 1,7,64, got {text!r}") from e
    if not sizes or min(sizes) < 1:
        raise UsageError(f"--batch-sizes needs positive integers, got {text!r}")
    return sizes


def load_images(folder: str | Path, metadata: ModelMetadata, count: int) -> np.ndarray:
    """``count`` normalised images (count, C, H, W) from a folder, cycled if few, preprocessed exactly as the service
    and training do (``capserve.data.images``: decode, orient, convert, centre square, resize, normalise)."""
    pass

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


def random_images(metadata: ModelMetadata, count: int, seed: int) -> np.ndarray:
    return sample_images(metadata, count, seed)  # the images of the service's bf16 start-up check at seed 0


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


def run(args: argparse.Namespace) -> int:
    from capserve.runtime.torch_backend import TorchRuntime

    against = args.against or (args.artifact if Path(args.artifact).is_dir() else None)
    if against is None:
        raise UsageError(f"give --against: the model directory {args.artifact} was exported from")
    if not Path(against).is_dir():
        raise UsageError(f"--against {against} is not a model directory (model.safetensors + config.json)")
    if args.int8:
        from capserve.export.int8 import verify_int8

        return verify_int8(args.artifact, against, args.data, args.min_agreement)
    options = {}
    if args.precision != "fp32":
        backend = args.backend or infer_backend(args.artifact)
        options["precision"], reason = resolve_precision(args.precision, backend, args.device)
        print(f"precision {options['precision']} ({reason})")
    sizes = parse_batch_sizes(
        args.batch_sizes or (str(SAMPLE_SIZE) if options.get("precision") == "bf16" else "1,7,64")
    )
    artifact = load_runtime(args.artifact, backend=args.backend, device=args.device, **options)
    meta = artifact.metadata
    reference = TorchRuntime(against, device="cpu", iterations=meta.iterations)
    ref_meta = reference.metadata
    for field in ("name", "labels", "task", "in_channels", "image_size", "mean", "std"):
        if getattr(meta, field) != getattr(ref_meta, field):
            raise UsageError(
                f"{args.artifact} is a different model than {against}: {field} "
                f"{getattr(meta, field)!r} vs {getattr(ref_meta, field)!r}"
            )
    weights_note = ""
    if meta.weights_sha256 != ref_meta.weights_sha256:  # another file; maybe the same weights saved again
        a, b = meta.weights_sha256[:12], ref_meta.weights_sha256[:12]
        weights_note = f"; note: weights_sha256 differs ({a}… vs {b}…): exported from another weights file"
    precision = artifact.precision
    atol, rtol, min_agreement = DEFAULTS.get(precision, DEFAULTS["fp32"])
    atol = atol if args.atol is None else args.atol
    rtol = rtol if args.rtol is None else args.rtol
    min_agreement = min_agreement if args.min_agreement is None else args.min_agreement

    count = max(sizes)
    if args.images:
        images, source = load_images(args.images, meta, count), f"images from {args.images}"
    else:
        images, source = random_images(meta, count, args.seed), f"random images (seed {args.seed})"
    routing = "no routing (CNN)" if meta.iterations is None else f"T={meta.iterations}"
    print(
        f"{args.artifact}: {meta.name}, {routing}, {precision}, {artifact.backend} on "
        f"{', '.join(artifact.providers)}; eager fp32 reference {against}; {source}{weights_note}"
    )
    agree = "labels agree" if meta.task == "multi_label" else "top-1 agree"  # per image, all decisions equal
    print(f"tolerance: max |Δlogit| <= {atol:g} + {rtol:g}·max|logit|, {agree} >= {min_agreement:g}")
    print(f"{'batch':>5}  {'max|Δlogit|':>11}  {'rel':>9}  {'max|Δprob|':>10}  {agree:>12}  result")
    failed = False
    for row in compare(reference, artifact, images, sizes):
        ok = row.within(atol, rtol, min_agreement)
        failed |= not ok
        print(
            f"{row.batch:>5}  {row.max_abs:>11.3e}  {row.max_rel:>9.2e}  {row.max_abs_prob:>10.3e}  "
            f"{row.agreement:>12.4f}  {'ok' if ok else 'FAIL'}"
        )
    print("FAILED: tolerances exceeded" if failed else "passed")
    return 1 if failed else 0
