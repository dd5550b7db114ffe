"""``/explain``: the part-whole parse as numbers (routing vs uniform, selectivity) and as a heat-map PNG."""

from __future__ import annotations

import io

import numpy as np

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
