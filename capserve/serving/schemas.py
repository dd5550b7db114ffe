"""The HTTP answers as pydantic models: what the OpenAPI document publishes and the routes return."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

# ---------------------------------------------------------------------------- API results


class Label(BaseModel):
    label: str
    index: int
    probability: float


Iterations = Annotated[int | None, Field(description="routing iterations T; null: the model is a CNN without routing")]


class Classification(BaseModel):
    model: str
    iterations: Iterations
    predictions: list[Label] = Field(description="the top_k labels, most probable first")


class MultiLabel(BaseModel):
    model: str
    iterations: Iterations
    threshold: float | None = Field(description="the threshold the request set; None: the model's own thresholds")
    labels: list[Label] = Field(description="every label whose probability passed its threshold, most probable first")
    probabilities: dict[str, float]
    thresholds: dict[str, float]


class Capsule(BaseModel):
    type: int = Field(description="capsule type (channel) in the last grid capsule layer")
    row: int
    col: int
    routing_probability: float = Field(description="routing probability from this capsule to the class, in [0, 1]")
    vs_uniform: float = Field(description="routing_probability as a multiple of uniform routing (1/classes)")


class Occluded(BaseModel):
    probability: float = Field(description="the predicted class's probability on the whole image")
    log_odds: float = Field(description="its log-odds, log p − log(1 − p), on the whole image")
    window: int = Field(description="side of each greyed square, in pixels of the model's input")
    starts: list[int] = Field(description="first row (and column) of each window, in pixels of the model's input")
    probabilities: list[list[float]] = Field(description="the class's probability with window (row, col) greyed")
    drop: list[list[float]] = Field(
        description="fall of the class's log-odds when window (row, col) is greyed; > 0: evidence for the class"
    )
    forward_passes: int = Field(description="forward passes this map cost: windows² + 1")
    heatmap_png: str = Field(
        description="base64 PNG: the drop per pixel over the input on a fixed scale (none: the image as it is; "
        "the whole image's log-odds, a coin toss left: full red)"
    )


class Explained(BaseModel):
    model: str
    iterations: int
    prediction: Label
    uniform: float = Field(description="the routing probability of uniform routing: 1/classes")
    selectivity: float = Field(description="0: routing is uniform (nothing to see), 1: each capsule picks one class")
    grid: list[list[float]] = Field(description="mean routing probability to the class over capsule types, per cell")
    capsules: list[Capsule] = Field(description="the most strongly routed capsules, strongest first")
    heatmap_png: str = Field(
        description="base64 PNG: the grid vs uniform on a fixed log scale (1/4× blue, uniform "
        "pale, 4× red) over the input"
    )
    occlusion: Occluded = Field(
        description="occlusion sensitivity: where greying the image lowers the predicted class (served model's runtime)"
    )


# ---------------------------------------------------------------------------- GET /model


class ServedModel(BaseModel):
    """One served model: its metadata (``capserve.runtime.ModelMetadata``) and how it runs; no host paths."""

    model_config = ConfigDict(extra="forbid")  # the document lists every field: a new one must be added here

    name: str
    task: str
    labels: list[str]
    in_channels: int
    image_size: int
    mean: list[float]
    std: list[float]
    iterations: int | None
    thresholds: list[float] | None
    capserve_version: str
    weights_sha256: str
    input_shape: list[int] = Field(description="(C, H, W) of the pixels /logits and /multilabel_logits take")
    backend: str
    providers: list[str]
    precision: str
    precision_reason: str | None
    tag: str | None = Field(description="the BentoML model-store tag it was loaded from; null: a directory")


class Batching(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool
    max_batch_size: int
    max_latency_ms: int
    batches_in_flight: int


class Limits(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_bytes: int
    max_pixels: int
    max_images: int


class Versions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    capserve: str
    bentoml: str


class Choice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    value: int | str | None = Field(description="the value in use")
    set_by: str = Field(description="what set it: CAPSERVE_<NAME>, 'tuned (FILE NAME, CPU)' or 'default'")


class ServerDescription(BaseModel):
    """``GET /model``: what the server runs."""

    model_config = ConfigDict(extra="forbid")

    worker: int = Field(ge=0, description="this worker's index, counted from 0 (CAPSERVE_WORKERS)")
    workers: int = Field(ge=1, description="how many workers the server runs")
    device: str = Field(description="where this worker runs: cpu, or its GPU (cuda:N)")
    threads: int = Field(ge=1, description="intra-op threads of this worker's sessions")
    lone_request_threads: int = Field(ge=1, description="threads a lone request runs on: this worker's (threads)")
    ui: bool = Field(description="whether the web page is served at /ui (CAPSERVE_UI)")
    single_label: ServedModel
    multi_label: ServedModel | None
    explain: ServedModel | None
    batching: Batching
    limits: Limits
    versions: Versions
    choices: dict[str, Choice] = Field(
        description="each choice `capserve tune` may make (backend, precision, artifact, workers, threads, "
        "max_batch_size): its value and what set it (docs/deploy.md)"
    )


class ErrorBody(BaseModel):
    """Every error answer, whatever its status."""

    model_config = ConfigDict(extra="forbid")

    error: str = Field(description="what was wrong with the request, and how to fix it; one line")
