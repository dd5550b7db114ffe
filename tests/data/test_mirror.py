"""Whether a user's labels survive a mirror (``capserve.data.mirror``), the measure behind a capsule run's shifts
and mirrors on few pictures: marks that are their own mirror image, strokes that a mirror swaps, and labels that
ignore the pictures."""

from __future__ import annotations

import numpy as np
import torch
from support.data import decoded_training, write_marks, write_strokes

from capserve.data.mirror import MIRROR_SHARE, measure_mirror


def test_marks_a_mirror_keeps_survive_it_and_strokes_it_swaps_do_not(tmp_path):
    rng = np.random.default_rng(0)
    marks = measure_mirror(*decoded_training(write_marks(tmp_path / "marks", 30, rng, placed=False)))
    strokes = measure_mirror(*decoded_training(write_strokes(tmp_path / "strokes", 30, rng)))
    assert marks.share < MIRROR_SHARE <= strokes.share
    assert marks.survives and not strokes.survives
    assert "may not" in strokes.reason() and "may not" not in marks.reason()


def test_a_mirrored_set_measures_as_the_set_itself(tmp_path):
    """Mirroring every picture swaps the strokes' labels but not what a mirror does to them."""
    images, targets = decoded_training(write_strokes(tmp_path / "strokes", 30, np.random.default_rng(1)))
    plain, mirrored = measure_mirror(images, targets), measure_mirror(images.flip(-1), targets)
    assert not plain.survives and not mirrored.survives
    assert abs(plain.share - mirrored.share) < 0.5 * plain.share


def test_labels_that_ignore_the_pictures_never_survive_a_mirror():
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (200, 3, 32, 32), dtype=torch.uint8, generator=g)
    mirror = measure_mirror(images, torch.randint(0, 4, (200,), generator=g))
    assert mirror.share == float("inf") and not mirror.survives
