"""The route tables: which field of which route carries an image, which routes need the multi-label model, and
each route's parameters."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from capserve.serving.settings import Settings

# Both ways to start a server with one: `capserve serve MODEL` alone serves no multi-label model, and its users know
# the option, not the variable (which `make serve`, `bentoml serve` and containers read)
NO_MULTILABEL_MODEL = (
    "no multi-label model is served: start the server with one, `capserve serve MODEL --multilabel-model "
    "MULTILABEL_MODEL` (or CAPSERVE_MULTILABEL_MODEL=MULTILABEL_MODEL for `make serve` and `bentoml serve`), "
    "MULTILABEL_MODEL being a multi_label model directory, .onnx file or model-store tag"
)


MULTILABEL_ROUTES = ("/multilabel", "/multilabel_logits")


def unavailable_routes(settings: Settings) -> dict[str, str]:
    """Routes this server answers with 501 before BentoML sees them, each with its how-to-fix message.

    The batchable ``/multilabel_logits`` runs in BentoML's batching task, outside the request, and BentoML 1.4.40
    replaces the message of a 5xx raised there with a generic one (``api_endpoint_wrapper``); answered here, the
    message reaches the client. Fixed upstream when a batchable API's 5xx keeps its message
    (tests/serving/test_service_paths.py's ``test_501_says_how_to_fix`` without this table)."""
    if settings.multilabel_model.strip().lower() == "none":
        return dict.fromkeys(MULTILABEL_ROUTES, NO_MULTILABEL_MODEL)
    return {}


def route_parameters(apis: Mapping[str, Any]) -> dict[str, frozenset[str]]:
    """Each BentoML API's route → its parameter names (the fields of its input model), for ``RequestGuard``."""
    return {api.route: frozenset(api.input_spec.model_fields) for api in apis.values()}


FILE_FIELDS = {"/classify": "image", "/classify_batch": "images", "/multilabel": "image", "/explain": "image"}


LIST_FIELDS = frozenset({"images"})  # file fields that take a list of images (the API's ``list[ImageFile]``)


ARRAY_ROUTES = {"/logits": False, "/multilabel_logits": True}  # the pixel-tensor routes → multilabel


UI_ROUTE = "/ui"  # the web page (capserve.serving.ui), unless CAPSERVE_UI=0


# answered without an API key: probes, Prometheus scrapes and the web page, which holds no data (its calls to the API
# send the key the person types into it)
OPEN_ROUTES = ("/livez", "/readyz", "/metrics", UI_ROUTE)
