"""The HTTP-only bodies as pydantic models (``GET /model``, error bodies): what the OpenAPI document publishes."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

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
    unfamiliarity: str = Field(
        description="whether its answers carry an unfamiliarity score, and on what it was calibrated"
    )


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
