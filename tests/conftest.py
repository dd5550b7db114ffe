"""Fixtures shared by every test folder. Plain helpers (tiny models, a served test server, data writers, the
real-image fixtures) live in ``tests/support/``; test modules never import each other or this file."""

from __future__ import annotations

import pytest
from support.models import CAPSULE_MODELS


@pytest.fixture(params=CAPSULE_MODELS)
def model_name(request) -> str:
    """Each capsule network configuration (the baseline CNNs have tests of their own)."""
    return request.param
