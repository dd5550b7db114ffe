"""Fixtures shared by every test folder. Plain helpers (tiny models, a served test server, data writers, the
real-image fixtures) live in ``tests/support/``; test modules never import each other or this file."""

from __future__ import annotations

import pytest
from support.models import CAPSULE_MODELS


@pytest.fixture(params=CAPSULE_MODELS)
def model_name(request) -> str:
    """Each capsule network configuration (the baseline CNNs have tests of their own)."""
    return request.param


@pytest.fixture(autouse=True)
def own_cache(tmp_path_factory, monkeypatch) -> None:
    """Each test keeps what capserve caches (``capserve.train.amp``'s measured step times) in a folder of its own,
    never in the home folder, and never one another test filled (the training runs it starts inherit it)."""
    monkeypatch.setenv("CAPSERVE_CACHE_DIR", str(tmp_path_factory.mktemp("capserve-cache")))
