"""``logits_of``, the one pixels -> logits step of the service and ``Predictor``: integer pixels outside [0, 255]
are refused as bad input in the server's words (a 400 there), never wrapped into other pixels, for in-process
callers too."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from capserve.pipeline.errors import ErrorKind, RequestError
from capserve.pipeline.inference import logits_of
from capserve.pipeline.models import OpenOptions, open_model

SHIPPED = Path(__file__).resolve().parents[2] / "models" / "cifar10"


@pytest.mark.parametrize("value", [256, -1])
def test_integer_pixels_outside_0_255_are_bad_input_not_wrapped(value):
    runtime, _, _ = open_model(str(SHIPPED), OpenOptions(), explain=False)
    good = np.full((1, 3, 32, 32), 7, dtype=np.int64)
    assert logits_of(runtime, good).shape == (1, len(runtime.metadata.labels))
    with pytest.raises(RequestError, match=r"integer pixels in \[0, 255\]") as e:
        logits_of(runtime, np.full((1, 3, 32, 32), value, dtype=np.int64))
    assert e.value.kind is ErrorKind.BAD_INPUT


def test_integer_pixels_at_0_and_255_answer_as_the_same_uint8_image():
    """JSON tensors arrive as int64: the ends of the range are pixels like any other (a white or black region)."""
    runtime, _, _ = open_model(str(SHIPPED), OpenOptions(), explain=False)
    pixels = np.random.default_rng(0).integers(0, 256, (2, 3, 32, 32)).astype(np.uint8)
    pixels[0, :, :8] = 255  # a white band
    pixels[1, :, :8] = 0  # a black one
    expected = logits_of(runtime, pixels)
    assert np.array_equal(logits_of(runtime, pixels.astype(np.int64)), expected)
