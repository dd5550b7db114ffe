"""Fixtures shared by the serving tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.models import tiny_model
from support.server import export


@pytest.fixture(scope="session")
def tiny_cifar10(tmp_path_factory) -> Path:
    """A random-weight cifar10-resnet model folder with its ONNX graphs (predictions and explanations); read-only."""
    return export(tiny_model("cifar10-resnet"), tmp_path_factory.mktemp("tiny") / "cifar10", explain=True)
