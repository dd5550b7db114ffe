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


@pytest.fixture(autouse=True, scope="session")
def servers_start_on_the_default_runtime():
    """Servers the tests start (and those their subprocesses start) serve ONNX Runtime fp32 unless a test chooses:
    without this, a server measures the runtimes that apply on the CPU it runs on at start-up
    (``capserve.serving.runtimes``) and could serve int8 or bf16 there, whose answers differ from eager fp32.
    tests/serving/test_runtimes.py turns the measurement on."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CAPSERVE_MEASURE_RUNTIMES", "0")
        yield
