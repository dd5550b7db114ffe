"""``/explain``: the part-whole parse as numbers (routing vs uniform, selectivity) and as a heat-map PNG, and occlusion
sensitivity (where greying the image lowers the predicted class's probability) as numbers and as a PNG; ``explained``
puts them together into the answer."""

from __future__ import annotations

import base64
import io
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from capserve.data.preprocess import normalize_images
from capserve.pipeline.answers import familiar, top_labels
from capserve.pipeline.schemas import Capsule, Explained, Occluded
from capserve.runtime import Runtime
from capserve.runtime.outputs import softmax

__all__ = [
    "Occlusion",
    "explained",
    "heatmap_png",
    "occlusion",
    "occlusion_png",
    "selectivity",
    "vs_uniform",
]

# A diverging blue → pale → red ramp for the heat-map (no plotting library in the server): the middle is uniform.
RAMP = np.array(
    [
        [49, 54, 149],
        [69, 117, 180],
        [116, 173, 209],
        [224, 243, 248],
        [254, 224, 144],
        [253, 174, 97],
        [244, 109, 67],
        [215, 48, 39],
    ],
    dtype=np.float32,
)


HEATMAP_OCTAVES = 2.0  # the colour scale spans 1/4× (blue) .. uniform (middle) .. 4× uniform (red)


def vs_uniform(probabilities: np.ndarray, classes: int) -> np.ndarray:
    """Routing probabilities as multiples of uniform routing (1/classes): 1 = no preference."""
    return probabilities * classes


def selectivity(part_whole: np.ndarray) -> float:
    """How far routing is from uniform, in [0, 1]: 1 − mean normalised entropy of each grid capsule's routing
    distribution over the classes (part_whole (C, H, W, I), summing to 1 over C). 0: every capsule routes
    uniformly (the picture shows nothing); 1: every capsule routes to one class."""
    C = part_whole.shape[0]
    p = np.clip(part_whole.reshape(C, -1), 1e-12, 1.0)  # (C, H·W·I)
    entropy = -(p * np.log(p)).sum(axis=0) / np.log(C)  # (H·W·I,) in [0, 1]
    return float(np.clip(1.0 - entropy.mean(), 0.0, 1.0))


def heatmap_png(image: np.ndarray, grid: np.ndarray, scale: int = 8, alpha: float = 0.55) -> bytes:
    """A PNG of ``grid`` (h, w), routing as multiples of uniform, on a FIXED log scale (``HEATMAP_OCTAVES``
    octaves either side of uniform, which is the ramp's pale middle), bilinearly upsampled and blended over
    ``image`` uint8 (C, H, W). Near-uniform routing stays pale: the picture is never stretched to full colour."""
    from PIL import Image

    C, H, W = image.shape
    g = (np.log2(np.clip(grid, 1e-6, None)) / HEATMAP_OCTAVES + 1) / 2  # (h, w): 0.5 is uniform
    size = (W * scale, H * scale)
    g = np.asarray(Image.fromarray(g.astype(np.float32), "F").resize(size, Image.Resampling.BILINEAR))  # (H', W')
    position = np.clip(g, 0, 1) * (len(RAMP) - 1)
    lo = np.floor(position).astype(int).clip(0, len(RAMP) - 2)
    colors = RAMP[lo] + (position - lo)[..., None] * (RAMP[lo + 1] - RAMP[lo])  # (H', W', 3)
    base = np.asarray(Image.fromarray(image[0] if C == 1 else image.transpose(1, 2, 0)).convert("RGB"))
    base = np.asarray(Image.fromarray(base).resize(size, Image.Resampling.NEAREST), dtype=np.float32)
    blended = ((1 - alpha) * base + alpha * colors).round().clip(0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(blended, "RGB").save(buffer, format="PNG")
    return buffer.getvalue()


# ---------------------------------------------------------------------------- occlusion sensitivity

# Occlusion windows per side: a square of a quarter of the input's side, at this many evenly spaced positions along
# each axis, so each /explain costs OCCLUSION_WINDOWS² + 1 forward passes whatever the model. A finer grid of
# overlapping windows costs more passes and landed no better on the objects (docs/web-page.md, "Explanations").
OCCLUSION_WINDOWS = 4


OCCLUSION_PATCH_FRACTION = 4  # a window's side is the input's side divided by this


OCCLUSION_FULL_SCALE = 1.0  # the least log-odds drop drawn full red, for a class predicted without a margin


@dataclass(frozen=True)
class Occlusion:
    """What greying each window of an image did to the predicted class. Changes are measured in the class's log-odds,
    log p − log(1 − p): a confident model's probability sits at 1.0 whatever one window holds, its log-odds do not."""

    label: int  # the class followed: the prediction on the whole image
    probability: float  # its probability on the whole image
    log_odds: float  # its log-odds on the whole image
    patch: int  # a window's side, in pixels of the model's input
    starts: list[int]  # each window's first row (and column), in pixels
    probabilities: np.ndarray  # (N, N): the class's probability with window (row, col) greyed
    drop: np.ndarray  # (N, N): its log-odds on the whole image − with window (row, col) greyed; > 0: evidence for it
    pixels: np.ndarray  # (H, W): per pixel, the mean drop of the windows that cover it
    forward_passes: int


def occlusion_windows(side: int, windows: int = OCCLUSION_WINDOWS) -> tuple[int, list[int]]:
    """A window's side and the first pixel of each of ``windows`` evenly spaced windows along an axis of ``side``."""
    patch = max(side // OCCLUSION_PATCH_FRACTION, 1)
    starts = np.round(np.linspace(0, side - patch, windows)).astype(int)
    return patch, [int(s) for s in starts]


def occluded_copies(pixels: np.ndarray, grey: np.ndarray, windows: int = OCCLUSION_WINDOWS) -> np.ndarray:
    """uint8 (C, H, W) → uint8 (1 + N², C, H, W): the image, then one copy per window (row-major) with that window
    filled with ``grey`` (C,), the model's mean colour, which normalises to zero."""
    _, H, W = pixels.shape
    patch_h, rows = occlusion_windows(H, windows)
    patch_w, cols = occlusion_windows(W, windows)
    copies = np.repeat(pixels[None], 1 + len(rows) * len(cols), axis=0)  # (1 + N², C, H, W)
    for k, (r, c) in enumerate((r, c) for r in rows for c in cols):
        copies[1 + k, :, r : r + patch_h, c : c + patch_w] = grey[:, None, None]
    return copies


def occlusion(
    pixels: np.ndarray,
    mean: np.ndarray,
    logits_of: Callable[[np.ndarray], np.ndarray],
    windows: int = OCCLUSION_WINDOWS,
) -> Occlusion:
    """Occlusion sensitivity of one image uint8 (C, H, W): each window greyed in turn (to ``mean``, the model's
    per-channel mean in [0, 1]) and the predicted class's log-odds measured again. ``logits_of`` maps uint8
    images (B, C, H, W) to logits (B, classes); it gets all 1 + windows² copies in one call, which it may split into
    batches. A window whose greying lowers the probability holds evidence for the class."""
    C, H, W = pixels.shape
    grey = np.clip(np.round(np.asarray(mean, dtype=np.float64) * 255), 0, 255).astype(np.uint8)  # (C,)
    copies = occluded_copies(pixels, np.broadcast_to(grey, (C,)), windows)  # (1 + N², C, H, W)
    z = logits_of(copies).astype(np.float64)  # (1 + N², classes)
    label = int(z[0].argmax())
    others = np.delete(z, label, axis=1)  # (1 + N², classes − 1)
    top = others.max(axis=1)
    log_odds = z[:, label] - (top + np.log(np.exp(others - top[:, None]).sum(axis=1)))  # (1 + N²,): stable
    drop = (log_odds[0] - log_odds[1:]).reshape(windows, windows)  # (N, N)
    patch, starts = occlusion_windows(H, windows)
    patch_w, starts_w = occlusion_windows(W, windows)
    total, cover = np.zeros((H, W)), np.zeros((H, W))
    for i, r in enumerate(starts):
        for j, c in enumerate(starts_w):
            total[r : r + patch, c : c + patch_w] += drop[i, j]
            cover[r : r + patch, c : c + patch_w] += 1
    probabilities = 1 / (1 + np.exp(-log_odds))  # (1 + N²,): the softmax probability of the class
    return Occlusion(
        label=label,
        probability=float(probabilities[0]),
        log_odds=float(log_odds[0]),
        patch=patch,
        starts=starts,
        probabilities=probabilities[1:].reshape(windows, windows),
        drop=drop,
        pixels=total / np.maximum(cover, 1),  # (H, W); a pixel no window covers: 0
        forward_passes=len(copies),
    )


def occlusion_png(image: np.ndarray, occluded: Occlusion, scale: int = 8, alpha: float = 0.7) -> bytes:
    """A PNG of ``occluded.pixels`` over ``image`` uint8 (C, H, W), on a FIXED scale: a pixel is coloured by how much
    of the class's margin greying its windows took away, its log-odds drop over the whole image's log-odds (at least
    ``OCCLUSION_FULL_SCALE``), on a square-root scale (a quarter of the margin shows at half strength): none, the image
    as it is; all of it (a coin toss left), full red. A drop that is small against the margin stays faint: the picture
    is never stretched to full colour."""
    from PIL import Image

    C, H, W = image.shape
    share = np.sqrt(np.clip(occluded.pixels / max(occluded.log_odds, OCCLUSION_FULL_SCALE), 0, 1))  # (H, W)
    size = (W * scale, H * scale)
    share = np.asarray(Image.fromarray(share.astype(np.float32), "F").resize(size, Image.Resampling.NEAREST))
    warm = RAMP[len(RAMP) // 2 - 1 :]  # pale → red: the warm half of the routing ramp
    position = share * (len(warm) - 1)  # (H', W')
    lo = np.floor(position).astype(int).clip(0, len(warm) - 2)
    colors = warm[lo] + (position - lo)[..., None] * (warm[lo + 1] - warm[lo])  # (H', W', 3)
    base = np.asarray(Image.fromarray(image[0] if C == 1 else image.transpose(1, 2, 0)).convert("RGB"))
    base = np.asarray(Image.fromarray(base).resize(size, Image.Resampling.NEAREST), dtype=np.float32)
    weight = (alpha * share)[..., None]  # (H', W', 1): no drop leaves the image untouched
    blended = ((1 - weight) * base + weight * colors).round().clip(0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(blended, "RGB").save(buffer, format="PNG")
    return buffer.getvalue()


# ---------------------------------------------------------------------------- the answer


def explained(
    pixels: np.ndarray,
    explainer: Runtime,
    logits_of: Callable[[np.ndarray], np.ndarray],
    capsules: int,
    unfamiliarity: np.ndarray | None = None,
) -> Explained:
    """``/explain``'s answer for one image uint8 (C, H, W): ``explainer``'s prediction and part-whole parse (the
    ``capsules`` grid capsules routing most strongly to the predicted class), the occlusion map of the served
    model, whose logits ``logits_of`` gives for uint8 images (B, C, H, W), and the image's ``unfamiliarity`` (1,)
    when the served model has one."""
    meta = explainer.metadata
    explanation = explainer.explain(normalize_images(pixels[None], meta))
    occluded = occlusion(pixels, np.asarray(meta.mean), logits_of)
    probabilities = softmax(explanation.logits)[0]  # (C,)
    C = len(meta.labels)
    routing = explanation.part_whole[0, int(probabilities.argmax())]  # (H, W, I)
    _, W, I = routing.shape
    order = np.argsort(-routing.reshape(-1), kind="stable")[: min(capsules, routing.size)]
    top = [
        Capsule(
            type=int(k % I),
            row=int(k // (W * I)),
            col=int(k // I % W),
            routing_probability=float(routing.flat[k]),
            vs_uniform=float(routing.flat[k] * C),
        )
        for k in order
    ]
    grid = routing.mean(axis=-1)  # (H, W)
    return Explained(
        model=meta.name,
        iterations=meta.iterations,
        prediction=top_labels(probabilities, meta.labels, 1)[0],
        uniform=1.0 / C,
        selectivity=selectivity(explanation.part_whole[0]),
        grid=grid.tolist(),
        capsules=top,
        heatmap_png=base64.b64encode(heatmap_png(pixels, vs_uniform(grid, C))).decode(),
        occlusion=Occluded(
            probability=occluded.probability,
            log_odds=occluded.log_odds,
            window=occluded.patch,
            starts=occluded.starts,
            probabilities=occluded.probabilities.tolist(),
            drop=occluded.drop.tolist(),
            forward_passes=occluded.forward_passes,
            heatmap_png=base64.b64encode(occlusion_png(pixels, occluded)).decode(),
        ),
        **familiar(unfamiliarity, 1)[0],
    )
