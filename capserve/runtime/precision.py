"""Serving precision: which arithmetic a runtime uses, whether the CPU has bf16, and whether bf16 answers agree.

One place for the bf16 decisions that ``capserve.serving`` (the HTTP service) and ``capserve verify`` share:

- ``native_bf16()``: does this processor do bf16 arithmetic in hardware (AVX-512 BF16 or AMX-BF16 on x86, the
  BF16 extension on Arm), as torch's cpuinfo and oneDNN report it? Without it, bf16 autocast is emulated
  and slower than fp32.
- ``resolve_precision(requested, backend)``: ``fp32`` | ``bf16`` | ``auto`` → the precision to load, or a
  ``PrecisionError`` that says what to change (bf16 needs the torch backend).
- ``decisions`` / ``agreement``: what a user acts on (top-1 for single-label models, the set of labels past
  their thresholds for multi-label ones) and the fraction of images on which two runtimes decide the same.
- ``check_bf16``: the start-up check: bf16 against fp32 on a fixed, seeded sample; at or above ``BF16_MIN_AGREEMENT``
  bf16 is kept, below it the caller falls back to fp32.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from capserve.errors import PrecisionError
from capserve.runtime.base import Runtime
from capserve.runtime.metadata import ModelMetadata
from capserve.runtime.outputs import multi_label_decisions

log = logging.getLogger(__name__)

PRECISIONS = ("fp32", "bf16", "auto")
BF16_BACKENDS = ("torch",)  # ONNX Runtime (CPU) and TensorRT take their precision from the exported graph
# The start-up check's sample and bound. bf16 keeps 8 bits of mantissa: near-ties between two classes can flip,
# so agreement on seeded noise images (the hardest case: no class is clearly present) is below 1 even for a good
# model; a model below the bound has lost more to bf16 than rounding near ties explains (a broken one, e.g. logits
# on a large offset that bf16 rounds to ties, falls far below it). docs/benchmarks/runtimes.md has the shipped
# models' figures.
BF16_MIN_AGREEMENT = 0.9
SAMPLE_SIZE = 64
SAMPLE_SEED = 0


@dataclass(frozen=True)
class Bf16Support:
    """Whether this CPU does bf16 arithmetic natively, and what torch reported (for logs and GET /model)."""

    native: bool
    reason: str


def native_bf16() -> Bf16Support:
    """Native bf16 arithmetic on this CPU, from torch's cpuinfo capabilities and oneDNN's bf16 check.

    x86: AVX-512 BF16 or AMX-BF16 (oneDNN's own check also passes on plain AVX-512, where bf16 is emulated, so
    it is not enough alone). Arm: the BF16 extension (NEON or SVE). Anything else, or a torch too old to say:
    not native.
    """
    import torch

    get_capabilities = getattr(getattr(torch, "cpu", None), "get_capabilities", None)
    if get_capabilities is None:
        return Bf16Support(False, f"torch {torch.__version__} cannot report CPU capabilities")
    caps = get_capabilities()
    arch = str(caps.get("architecture", "unknown"))
    if arch in ("x86_64", "x86", "i386", "AMD64"):
        found = [flag for flag in ("avx512_bf16", "amx_bf16") if caps.get(flag, False)]
    elif arch in ("arm64", "aarch64"):
        found = [flag for flag in ("bf16", "sve_bf16") if caps.get(flag, False)]
    else:
        found = []
    if not found:
        return Bf16Support(False, f"{arch} CPU without bf16 instructions (torch.cpu.get_capabilities)")
    if not _onednn_bf16():
        return Bf16Support(False, f"{arch} CPU has {', '.join(found)} but this torch's oneDNN cannot use bf16")
    return Bf16Support(True, f"{arch} CPU with {', '.join(found)}")


def _onednn_bf16() -> bool:
    """oneDNN (mkldnn), which runs torch's bf16 convolutions and matmuls on CPUs, can use bf16 here."""
    import torch

    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def resolve_precision(requested: str, backend: str, device: str = "cpu") -> tuple[str, str]:
    """The precision to load and why: ``requested`` is ``fp32``, ``bf16`` or ``auto``.

    ``auto`` picks bf16 for the torch backend on a CPU with native bf16 arithmetic, and fp32 otherwise (ONNX
    Runtime and TensorRT artifacts carry their precision in the graph; a GPU's choice is fp16/bf16 at export).
    ``bf16`` with another backend raises ``PrecisionError``; on a CPU without native bf16 it is served
    (emulated, slower) with a warning.
    """
    if requested not in PRECISIONS:
        raise PrecisionError(f"precision {requested!r}; choose one of: {', '.join(PRECISIONS)}")
    on_cpu = device == "cpu"
    if requested == "bf16":
        if backend not in BF16_BACKENDS:
            raise PrecisionError(
                f"bf16 needs the torch backend; the {backend} backend serves the precision of "
                "its exported graph. Use backend torch, or precision fp32/auto"
            )
        if on_cpu:
            support = native_bf16()
            if not support.native:
                log.warning(
                    "bf16 requested on a CPU without native bf16 (%s): emulated, likely slower than fp32",
                    support.reason,
                )
                return "bf16", f"requested; emulated: {support.reason}"
            return "bf16", f"requested; {support.reason}"
        return "bf16", "requested"
    if requested == "fp32":
        return "fp32", "requested"
    if backend not in BF16_BACKENDS:
        return "fp32", f"auto: the {backend} backend serves its exported graph's precision"
    if not on_cpu:
        return "fp32", f"auto: bf16 is chosen on CPUs only (device {device})"
    support = native_bf16()
    return ("bf16" if support.native else "fp32"), f"auto: {support.reason}"


# ---------------------------------------------------------------------------------------------------- agreement


def decisions(logits: np.ndarray, metadata: ModelMetadata) -> np.ndarray:
    """What a user acts on: the top-1 class (single-label), or every label past its threshold (multi-label)."""
    if metadata.task != "multi_label":
        return logits.argmax(1)[:, None]  # (B, 1)
    return multi_label_decisions(logits, metadata.thresholds)  # (B, C)


def agreement(reference: np.ndarray, candidate: np.ndarray, metadata: ModelMetadata) -> float:
    """Fraction of images (rows of logits (B, C)) on which both decide the same: top-1, or the whole label set."""
    return float((decisions(candidate, metadata) == decisions(reference, metadata)).all(axis=1).mean())


def sample_images(metadata: ModelMetadata, count: int = SAMPLE_SIZE, seed: int = SAMPLE_SEED) -> np.ndarray:
    """The fixed check sample: ``count`` seeded uniform-noise images, normalised: float32 (count, C, H, W)."""
    from capserve.data.preprocess import normalize_numpy

    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(count, *metadata.input_shape), dtype=np.uint8)  # (B, C, H, W)
    return normalize_numpy(pixels, metadata.mean, metadata.std)


@dataclass(frozen=True)
class AgreementReport:
    """bf16 against fp32 on the check sample."""

    agreement: float  # fraction of images with the same decision
    images: int
    bound: float
    measure: str  # "top-1" or "label set"
    max_abs_logit: float  # max |Δlogit|, for the log
    candidate: str = "bf16"  # what was compared with fp32 (capserve.export.int8's gate: "int8")
    sample: str = "seeded images"

    @property
    def passed(self) -> bool:
        return self.agreement >= self.bound

    def __str__(self) -> str:
        return (
            f"{self.candidate} vs fp32 {self.measure} agreement {self.agreement:.4f} on {self.images} "
            f"{self.sample} (bound {self.bound:g}), max |Δlogit| {self.max_abs_logit:.3g}"
        )


def compare_precisions(
    reference: Runtime, candidate: Runtime, images: np.ndarray, bound: float = BF16_MIN_AGREEMENT, batch_size: int = 64
) -> AgreementReport:
    """Agreement of ``candidate`` (e.g. bf16) with ``reference`` (fp32) on normalised ``images`` (N, C, H, W)."""
    ref = reference.predict_in_batches(images, batch_size)  # (N, C)
    out = candidate.predict_in_batches(images, batch_size)  # (N, C)
    meta = reference.metadata
    return AgreementReport(
        agreement=agreement(ref, out, meta),
        images=len(images),
        bound=bound,
        measure="label set" if meta.task == "multi_label" else "top-1",
        max_abs_logit=float(np.abs(out.astype(np.float64) - ref).max()),
    )


def check_bf16(runtime: Runtime, bound: float = BF16_MIN_AGREEMENT, count: int = SAMPLE_SIZE) -> AgreementReport:
    """The start-up check of a bf16 torch runtime: its decisions against its own fp32 on the fixed sample."""
    reference = runtime.at_precision("fp32")  # type: ignore[attr-defined]  # TorchRuntime: same weights, no autocast
    return compare_precisions(reference, runtime, sample_images(runtime.metadata, count), bound)


@dataclass(frozen=True)
class PrecisionChoice:
    """The precision a runtime serves at, and why: requested, chosen by ``auto``, or fallen back to after a check."""

    requested: str
    precision: str
    reason: str
    check: AgreementReport | None = None  # the bf16 start-up check, when one ran


def open_torch(
    path: str | Path,
    device: str = "cpu",
    iterations: int | None = None,
    requested: str = "auto",
    bound: float = BF16_MIN_AGREEMENT,
) -> tuple[Runtime, PrecisionChoice]:
    """A torch runtime for a model directory at the requested precision, bf16 checked against fp32 first.

    bf16 whose decisions agree with fp32 on the fixed sample less than ``bound`` falls back to fp32 (logged).
    Raises ``PrecisionError`` for an unknown precision and ``RuntimeLoadError`` for a bad model directory.
    """
    from capserve.runtime import load_runtime

    if not 0 <= bound <= 1:
        raise PrecisionError(f"the bf16 agreement bound must be in [0, 1], got {bound}")
    precision, reason = resolve_precision(requested, "torch", device)
    runtime = load_runtime(path, "torch", device, iterations=iterations, precision=precision)
    if precision != "bf16":
        runtime.precision_reason = reason
        return runtime, PrecisionChoice(requested, precision, reason)
    report = check_bf16(runtime, bound)
    if report.passed:
        log.info("%s: serving bf16 (%s): %s", path, reason, report)
        runtime.precision_reason = f"{reason}; {report}"
        return runtime, PrecisionChoice(requested, "bf16", runtime.precision_reason, report)
    log.warning("%s: bf16 disagrees with fp32, falling back to fp32: %s", path, report)
    fallback = runtime.at_precision("fp32")  # type: ignore[attr-defined]
    fallback.precision_reason = f"fell back from bf16: {report}"
    return fallback, PrecisionChoice(requested, "fp32", fallback.precision_reason, report)
