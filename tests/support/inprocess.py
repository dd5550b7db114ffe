"""The real service (``capserve.serving.service``: BentoML's app behind ``RequestGuard``) run in this process, for
tests that need a few requests through every layer without the seconds a ``bentoml serve`` takes to start."""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

MODULE = "capserve.serving.service"


def _import_fresh() -> Any:
    """The service module imported anew (it reads its settings at import), in a thread of its own: off the main
    thread, ``prepare_server_process`` leaves this process's signal handlers and environment alone."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            sys.modules.pop(MODULE, None)
            result["module"] = importlib.import_module(MODULE)
        except BaseException as e:  # re-raised in the caller's thread
            result["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["module"]


@contextlib.contextmanager
def in_process_service(tmp: Path, **env: str) -> Iterator[Any]:
    """A ``starlette.testclient.TestClient`` of the service with these ``CAPSERVE_*`` settings (one worker, batching
    as set), started (models loaded, warmed up) and stopped with the block. The environment is restored after."""
    with warnings.catch_warnings():  # starlette's note that it prefers httpx2; httpx is what this project has
        warnings.simplefilter("ignore", UserWarning)  # StarletteDeprecationWarning is one
        from starlette.testclient import TestClient

    settings = {"BENTOML_HOME": str(tmp / "bentoml"), "BENTOML_DO_NOT_TRACK": "True", "CAPSERVE_WORKERS": "1", **env}
    saved = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    registry = _metrics_registry()
    before = set(registry._collector_to_names)
    try:
        module = _import_fresh()
        with TestClient(module.CapsuleService.to_asgi(), raise_server_exceptions=False) as client:
            yield client
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        sys.modules.pop(MODULE, None)
        # each BentoML app registers its request metrics in the process's one registry: a second app in this
        # process would find them taken. capserve's own histogram is created once per process and stays.
        for collector, names in list(registry._collector_to_names.items()):
            if collector not in before and not any(name.startswith("capserve_") for name in names):
                registry.unregister(collector)


def _metrics_registry() -> Any:
    """The Prometheus registry BentoML's apps register their metrics in (prometheus_client keeps no public list of
    a registry's collectors: ``_collector_to_names`` is read)."""
    from bentoml._internal.configuration.containers import BentoMLContainer

    return BentoMLContainer.metrics_client.get().registry
