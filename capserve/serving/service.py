"""capserve over HTTP: a thin BentoML shell over ``capserve.serving.Capsules`` (settings, model loading, request
logic and errors live there). ``bentoml serve capserve.serving.service:CapsuleService`` (anywhere capserve is
installed), ``capserve serve``, or ``bentoml serve service:CapsuleService`` from the repository root; settings from
``CAPSERVE_*`` environment variables (docs/serving.md).

Importing this module prepares a server process (signal handlers, a Prometheus folder) and reads the settings: it is
meant to be imported by ``bentoml serve``, not by library code."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import bentoml
import numpy as np
from bentoml.validators import ContentType
from pydantic import Field

from capserve.serving import (
    GUARDED_UPLOAD,
    UI_ROUTE,
    Capsules,
    Classification,
    Explained,
    MultiLabel,
    PageApp,
    RequestGuard,
    count_worker_start,
    freeze_startup_heap,
    setup_server,
)

# BentoML takes a service's workers, batching limits and access log from its decorators' arguments, which run when
# `bentoml serve` imports this module: so the settings are read here, once, at import (a bad one: exit status 3)
SERVER = setup_server(__file__)

# a file upload in the API (OpenAPI, clients); served as the bytes RequestGuard parsed (guard.guarded_upload)
ImageFile = Annotated[Path, ContentType("image/*"), GUARDED_UPLOAD]


@bentoml.service(
    name="capserve",
    traffic={"timeout": 60},
    workers=SERVER.workers,
    metrics={"enabled": True},
    logging={"access": {"enabled": SERVER.settings.access_log}},
)
class CapsuleService:
    def __init__(self) -> None:
        self.capsules = Capsules(SERVER.settings, worker=SERVER.worker())  # loads, warms up; a failure: exit status 3
        SERVER.input_shapes.update(self.capsules.input_shapes)  # what RequestGuard checks pixel tensors against
        freeze_startup_heap()  # the garbage collector then skips what start-up left (libraries, models)
        count_worker_start()  # /metrics then tells a worker that died and came back

    def __is_ready__(self) -> bool:
        return self.capsules.ready

    @bentoml.api(**SERVER.batchable)
    async def logits(self, images: np.ndarray) -> np.ndarray:
        """Logits (B, classes) of the single-label model for uint8 pixels (B, C, H, W) in its input size."""
        return await self.capsules.logits(images)

    @bentoml.api(**SERVER.batchable)
    async def multilabel_logits(self, images: np.ndarray) -> np.ndarray:
        """Logits (B, classes) of the multi-label model for uint8 pixels (B, C, H, W) in its input size."""
        return await self.capsules.logits(images, multilabel=True)

    @bentoml.api
    async def classify(
        self, image: ImageFile, top_k: Annotated[int | None, Field(ge=1, le=1000)] = None
    ) -> Classification:
        """The top_k labels of one image (default: up to 5, never more than the model has), with softmax
        probabilities."""
        return await self.capsules.classify(image, top_k)

    @bentoml.api
    async def classify_batch(
        self, images: list[ImageFile], top_k: Annotated[int | None, Field(ge=1, le=1000)] = None
    ) -> list[Classification]:
        """One result per image, in order (the images run as one batch)."""
        return await self.capsules.classify_batch(images, top_k)

    @bentoml.api
    async def multilabel(
        self, image: ImageFile, threshold: Annotated[float | None, Field(gt=0, lt=1)] = None
    ) -> MultiLabel:
        """Labels whose sigmoid probability passes the model's per-class thresholds, or ``threshold`` for all."""
        return await self.capsules.multilabel(image, threshold)

    @bentoml.api
    async def explain(self, image: ImageFile, capsules: Annotated[int, Field(ge=1, le=1000)] = 10) -> Explained:
        """The prediction, its part-whole parse (routing to the class, per capsule, vs uniform routing) and its
        occlusion map (the class's log-odds as each window of the image is greyed)."""
        return await self.capsules.explain(image, capsules)

    @bentoml.api(route="/model")
    def model(self) -> dict[str, Any]:
        """The served models (store tags included), backend and providers in use, batching, limits, versions."""
        return self.capsules.describe()


if SERVER.settings.ui:  # the web page (capserve.serving.ui); CAPSERVE_UI=0 leaves /ui a 404
    CapsuleService.mount_asgi_app(PageApp(), path=UI_ROUTE)
CapsuleService.add_asgi_middleware(RequestGuard, **SERVER.guard_options(CapsuleService.apis))
