"""The answers as pydantic models (``/classify``, ``/multilabel``, ``/explain``): what the service returns and
``capserve predict`` writes, one copy for both."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field

# ---------------------------------------------------------------------------- API results


class Label(BaseModel):
    label: str
    index: int
    probability: float


Iterations = Annotated[int | None, Field(description="routing iterations T; null: the model is a CNN without routing")]
Unfamiliarity = Annotated[
    float | None,
    Field(
        description="how unlike the images the model learned from this one is: the distance of its class capsules "
        "to the training images', over the distance 95 % of the model's validation images stay within (above 1: "
        "unfamiliar); null: the model has no calibration (`capserve familiarity MODEL --data DATA`) or the "
        "server turned it off (CAPSERVE_UNFAMILIAR=0)"
    ),
]
Unfamiliar = Annotated[
    bool | None,
    Field(
        description="unfamiliarity above 1: the image is unlike anything the model learned, so its labels say little "
        "about it; null as unfamiliarity"
    ),
]


class Classification(BaseModel):
    model: str
    iterations: Iterations
    predictions: list[Label] = Field(description="the top_k labels, most probable first")
    unfamiliarity: Unfamiliarity = None
    unfamiliar: Unfamiliar = None


class MultiLabel(BaseModel):
    model: str
    iterations: Iterations
    threshold: float | None = Field(description="the threshold the request set; None: the model's own thresholds")
    labels: list[Label] = Field(description="every label whose probability passed its threshold, most probable first")
    probabilities: dict[str, float]
    thresholds: dict[str, float]
    unfamiliarity: Unfamiliarity = None
    unfamiliar: Unfamiliar = None


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
    unfamiliarity: Unfamiliarity = None
    unfamiliar: Unfamiliar = None
