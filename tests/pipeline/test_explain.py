"""``/explain``'s occlusion map has the picture's geometry: evidence placed in one corner of an image is drawn in that
corner of the map's PNG (a transposed map keeps every number of ``drop`` and shows it in the mirrored corner)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from capserve.pipeline.explain import occlusion, occlusion_png

SIDE = 32
HALF = SIDE // 2
MEAN = np.array([0.5, 0.5, 0.5])  # the model's mean colour: the grey each window is filled with

# (rows, columns) of each quadrant of the picture
QUADRANTS = {
    "top-left": (slice(0, HALF), slice(0, HALF)),
    "top-right": (slice(0, HALF), slice(HALF, SIDE)),
    "bottom-left": (slice(HALF, SIDE), slice(0, HALF)),
    "bottom-right": (slice(HALF, SIDE), slice(HALF, SIDE)),
}


def evidence_in(quadrant: str) -> tuple[np.ndarray, object]:
    """A black picture with a white square in ``quadrant``, and logits (B, 2) whose class 0 grows with the
    brightness of that quadrant alone: greying any window that covers the square takes evidence away."""
    rows, cols = QUADRANTS[quadrant]
    image = np.zeros((3, SIDE, SIDE), np.uint8)  # (C, H, W)
    image[:, rows, cols] = 255

    def logits_of(copies: np.ndarray) -> np.ndarray:  # (B, C, H, W) → (B, 2)
        brightness = copies[:, :, rows, cols].astype(np.float64).mean(axis=(1, 2, 3)) / 255  # (B,)
        return np.stack([8 * brightness - 2, np.zeros(len(copies))], axis=1)

    return image, logits_of


def drawn(image: np.ndarray, occluded) -> np.ndarray:
    """Per pixel of the map's PNG (drawn at the image's size, fully opaque), how far it is from the image: (H, W)."""
    png = np.asarray(Image.open(io.BytesIO(occlusion_png(image, occluded, scale=1, alpha=1.0))).convert("RGB"))
    return np.abs(png.astype(np.float64) - image.transpose(1, 2, 0)).sum(axis=-1)


@pytest.mark.parametrize("quadrant", ["top-right", "bottom-left", "top-left"])
def test_evidence_in_one_corner_is_drawn_in_that_corner(quadrant):
    image, logits_of = evidence_in(quadrant)
    occluded = occlusion(image, MEAN, logits_of)
    assert occluded.label == 0 and occluded.log_odds > 0
    changed = drawn(image, occluded)  # (H, W)
    rows, cols = QUADRANTS[quadrant]
    assert (changed[rows, cols] > 0).all(), "the square holding the evidence is not drawn"
    for other, (r, c) in QUADRANTS.items():
        if other != quadrant:
            # windows of the side's quarter, four per axis: none straddles two quadrants, so the others stay as they are
            assert not changed[r, c].any(), f"evidence in the {quadrant} drawn in the {other}"
    # the numbers agree with the picture: window (row i, column j) of ``drop`` covers rows i·8.. and columns j·8..
    i, j = np.unravel_index(np.argmax(occluded.drop), occluded.drop.shape)
    assert (occluded.starts[i] in range(SIDE)[rows]) and (occluded.starts[j] in range(SIDE)[cols])
