"""Fixtures of the training tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from support.data import write_marks


@pytest.fixture(scope="module")
def marks(tmp_path_factory) -> Path:
    """Marks anywhere on noise, 24 pixels a side: a run measures its class capsule transforms from them."""
    return write_marks(tmp_path_factory.mktemp("marks") / "marks", 10, np.random.default_rng(0), placed=True)
