"""What the pipeline refuses, as a kind of problem, without any transport's numbers: ``RequestError`` and its
``ErrorKind``. The HTTP service maps each kind to a status (``capserve.serving.app.STATUSES``), ``capserve predict``
to a row or a stop (``capserve.predict.predictor.RECORDED``)."""

from __future__ import annotations

import enum

__all__ = ["ErrorKind", "RequestError"]


class ErrorKind(enum.Enum):
    """What went wrong with a request to the pipeline."""

    BAD_INPUT = "bad input"  # not an image, a truncated one, pixels out of range, an option out of range
    TOO_LARGE = "too large"  # over a limit: an image's pixels, a request's images
    TOO_SMALL = "too small"  # an image with a side under the minimum, or zero-sized
    UNSUPPORTED = "unsupported"  # an image whose pixel mode has no conversion to the model's channels
    UNAVAILABLE = "unavailable"  # what this model or server cannot do: no multi-label model, no routing to explain
    BUSY = "busy"  # refused under load; the same request later may be answered


class RequestError(ValueError):
    """A request the pipeline refuses: ``kind`` says what went wrong, the message how to fix it."""

    def __init__(self, kind: ErrorKind, message: str):
        super().__init__(message)
        self.kind = kind
