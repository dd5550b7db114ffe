"""The HTTP service as plain Python (``service.py`` is a thin BentoML shell over it): ``Capsules`` (settings in,
one method per endpoint, answers as the ``schemas``), ``RequestGuard`` (the ASGI middleware in front of BentoML)
and ``setup_server`` (the service module's import-time work). Everything else is imported from its own module:
``settings``, ``tuned``, ``tune``, ``loadtest``, ``batching``, ``workers``, ``routes``, ``openapi``,
``process``, ``ui``; opening a model, decoding, answers and explanations are ``capserve.pipeline``'s. BentoML is
imported only inside the functions that need it.
"""

from __future__ import annotations

from capserve.pipeline.errors import RequestError
from capserve.pipeline.schemas import Classification, Explained, MultiLabel
from capserve.serving.app import Capsules
from capserve.serving.guard import GUARDED_UPLOAD, RequestGuard
from capserve.serving.process import ServerSetup, count_worker_start, freeze_startup_heap, setup_server
from capserve.serving.routes import UI_ROUTE
from capserve.serving.settings import Settings
from capserve.serving.ui import PageApp

__all__ = [
    "GUARDED_UPLOAD",
    "UI_ROUTE",
    "Capsules",
    "Classification",
    "Explained",
    "MultiLabel",
    "PageApp",
    "RequestError",
    "RequestGuard",
    "ServerSetup",
    "Settings",
    "count_worker_start",
    "freeze_startup_heap",
    "setup_server",
]
