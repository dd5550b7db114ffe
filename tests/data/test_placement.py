"""How a run on your own images chooses its class capsule transforms: the placement measure
(``capserve.data.placement``) on data whose labels do, or do not, follow where things lie."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw
from support.data import MARKS, decoded_training, mark_pixels, write_marks

from capserve.data.placement import (
    ALIGNED_RATIO,
    GRID,
    SMALL_SPREAD,
    edge_spread,
    explained_share,
    measure_placement,
)


def test_marks_in_their_place_keep_a_transform_per_position_and_marks_anywhere_share_one(tmp_path):
    rng = np.random.default_rng(0)
    aligned = measure_placement(*decoded_training(write_marks(tmp_path / "aligned", 30, rng, placed=False)))
    anywhere = measure_placement(*decoded_training(write_marks(tmp_path / "anywhere", 30, rng, placed=True)))
    assert aligned.ratio >= ALIGNED_RATIO > anywhere.ratio
    assert (aligned.class_weights, anywhere.class_weights) == ("per_position", "shared")
    assert "do not follow" in anywhere.reason() and "do not" not in aligned.reason()


def test_labels_that_ignore_the_pictures_never_count_as_following_position():
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (300, 3, 32, 32), dtype=torch.uint8, generator=g)
    placement = measure_placement(images, torch.randint(0, 4, (300,), generator=g))
    assert placement.in_place < placement.in_place_chance and not placement.aligned


def test_a_label_that_is_a_direction_drawn_anywhere_shares_the_transforms():
    """Which way a stroke runs, anywhere on the canvas: the direction also shapes where the edges spread (a
    horizontal stroke stays off the side columns), so the labels explain the edge positions well above chance; but
    far more of them shows whatever the shift, and a transform per position would have to learn each direction at
    every place."""
    rng = np.random.default_rng(2)
    images, targets = np.zeros((400, 32, 32), np.uint8), torch.zeros(400, dtype=torch.long)
    for n in range(400):
        direction = n % 4
        canvas = Image.fromarray(rng.integers(0, 60, (32, 32)).astype(np.uint8))
        length = rng.uniform(9, 13)  # half the stroke
        dx, dy = length * np.cos(direction * np.pi / 4), -length * np.sin(direction * np.pi / 4)
        cx, cy = rng.uniform(abs(dx), 32 - abs(dx)), rng.uniform(abs(dy), 32 - abs(dy))
        ImageDraw.Draw(canvas).line([(cx - dx, cy - dy), (cx + dx, cy + dy)], fill=230, width=2)
        images[n], targets[n] = np.asarray(canvas), direction
    placement = measure_placement(torch.from_numpy(images)[:, None].expand(-1, 3, -1, -1), targets)
    # the edge positions follow the labels: η² four times its shuffled level, where they alone would keep a transform
    # per position...
    assert placement.in_place >= 3 * placement.in_place_chance
    assert placement.ratio < ALIGNED_RATIO and placement.class_weights == "shared"  # ...but far less than their shapes


def test_multi_label_marks_each_in_a_place_of_its_own_follow_position():
    """Multi-hot targets: each label's mark at a corner of its own (aligned), or anywhere (not)."""
    rng = np.random.default_rng(1)
    corners = ((2, 2), (2, 24), (24, 2))
    for placed in (False, True):
        images = rng.integers(0, 90, (240, 32, 32)).astype(np.uint8)
        targets = torch.zeros(240, len(MARKS))
        for n in range(240):
            for k, kind in enumerate(MARKS):
                if rng.random() < 0.5:
                    y, x = rng.integers(0, 27, 2) if placed else corners[k]
                    images[n, y : y + 6, x : x + 6][mark_pixels(kind)] = 255
                    targets[n, k] = 1
        batch = torch.from_numpy(images)[:, None].expand(-1, 3, -1, -1)
        assert measure_placement(batch, targets).aligned is (not placed)


def test_the_share_is_between_label_variance_over_total():
    """Two labels on two one-value maps: the labels explain all of the variance, or none of it."""
    maps = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
    assert explained_share(maps, torch.tensor([0, 0, 1, 1])) == 1.0
    assert explained_share(maps, torch.tensor([0, 1, 0, 1])) == 0.0
    # multi-hot: the first label splits the maps as above (1), the second has the same mean with and without (0)
    assert explained_share(maps, torch.tensor([[1, 0], [1, 1], [0, 0], [0, 1]])) == 0.5


def test_small_marks_anywhere_on_a_plain_ground_are_small_things_and_on_noise_they_are_not(tmp_path):
    """How much of the picture the edges fill: a 6×6 mark anywhere on one grey fills little of it; the same marks on
    noise, whose edges fill the picture, do not count as small, nor do marks each in a place of its own (there the
    class transforms per position already read where they lie)."""
    rng = np.random.default_rng(0)
    small = measure_placement(*decoded_training(write_marks(tmp_path / "small", 30, rng, placed=True, plain=True)))
    noisy = measure_placement(*decoded_training(write_marks(tmp_path / "noisy", 30, rng, placed=True)))
    centred = measure_placement(*decoded_training(write_marks(tmp_path / "c", 30, rng, placed=False, plain=True)))
    assert small.spread < SMALL_SPREAD < noisy.spread and centred.spread < SMALL_SPREAD
    assert small.small_things and not noisy.small_things
    assert centred.aligned and not centred.small_things


def test_the_spread_runs_from_one_cell_to_the_whole_picture():
    one_cell = torch.zeros(2, GRID * GRID)
    one_cell[:, 5] = 1
    two_cells = torch.zeros(2, GRID * GRID)
    two_cells[:, [0, 9]] = 0.5
    even = torch.full((2, GRID * GRID), 1 / GRID**2)
    assert edge_spread(one_cell) == pytest.approx(1 / GRID**2)
    assert edge_spread(two_cells) == pytest.approx(2 / GRID**2)
    assert edge_spread(even) == pytest.approx(1)
