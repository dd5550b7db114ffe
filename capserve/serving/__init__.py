"""Everything the HTTP service does, as plain Python (``service.py`` is a thin BentoML shell over it): settings,
model sources, the request logic (``app.Capsules``), the ASGI guard, answer schemas, explanations, batching,
route tables and the server process's start-up rules. BentoML is imported only inside the functions that need it.
"""

from __future__ import annotations

from capserve.errors import ConfigurationError  # noqa: F401
from capserve.runtime.outputs import sigmoid, softmax  # noqa: F401  (were capserve.serving's)
from capserve.serving.answers import classifications, multilabel_answers, top_labels  # noqa: F401
from capserve.serving.app import (  # noqa: F401
    IMAGE_ERRORS,
    Capsules,
    RequestError,
    Upload,
    decode,
    http_error,
)
from capserve.serving.batching import (  # noqa: F401
    BATCHES_IN_FLIGHT,
    ENDPOINTS,
    INLINE_DECODE_BYTES,
    INLINE_DECODE_PIXELS,
    batch_runtime,
    batch_size_histogram,
    batches_for,
    lone_request_options,
)
from capserve.serving.explain import HEATMAP_OCTAVES, RAMP, heatmap_png, selectivity, vs_uniform  # noqa: F401
from capserve.serving.guard import (  # noqa: F401
    GUARDED_UPLOAD,
    UPLOAD_TOKEN,
    QuietClientErrors,
    RequestGuard,
    error_message,
    guarded_upload,
    one_error_shape,
    pixels_problem,
)
from capserve.serving.openapi import STATUS_REASONS, contract, openapi_3_0  # noqa: F401
from capserve.serving.process import (  # noqa: F401
    FAILED_START_EXIT_CODE,
    FAILED_START_SIGNAL,
    SERVER_PID_VARIABLE,
    freeze_startup_heap,
    prepare_server_process,
    report_failed_start,
    settings_or_exit,
    untraced_without_exporter,
    workers_or_exit,
)
from capserve.serving.routes import (  # noqa: F401
    ARRAY_ROUTES,
    FILE_FIELDS,
    INPUT_SHAPES,
    LIST_FIELDS,
    MULTILABEL_ROUTES,
    NO_MULTILABEL_MODEL,
    OPEN_ROUTES,
    route_parameters,
    unavailable_routes,
)
from capserve.serving.schemas import (  # noqa: F401
    Capsule,
    Classification,
    ErrorBody,
    Explained,
    Iterations,
    Label,
    MultiLabel,
    ServedModel,
    ServerDescription,
)
from capserve.serving.settings import BACKENDS, Settings, api_keys  # noqa: F401
from capserve.serving.sources import (  # noqa: F401
    ARTIFACTS,
    EXPLAIN_ARTIFACT,
    STORE_TAG,
    ModelSource,
    has_routing,
    open_model,
    resolve_model,
)
from capserve.serving.workers import Worker, assign, available_cores, current_index, visible_gpus, worker_count  # noqa: F401
