"""Image -> answer, below both the HTTP service (``capserve.serving``) and offline prediction
(``capserve.predict``), so that both answer alike: ``models`` (opening a model from ``OpenOptions`` or the
service's settings), ``decoding`` (bytes -> pixels; ``RequestError`` for a bad image, with its status),
``inference`` (pixels -> logits -> answers), ``answers`` and ``schemas`` (the answers), ``explain`` (the routing
parse and occlusion maps)."""

from __future__ import annotations

from capserve.pipeline.decoding import RequestError, decode
from capserve.pipeline.inference import answers_of, logits_of
from capserve.pipeline.models import OpenOptions, open_model
from capserve.pipeline.schemas import Classification, Explained, MultiLabel

__all__ = [
    "Classification",
    "Explained",
    "MultiLabel",
    "OpenOptions",
    "RequestError",
    "answers_of",
    "decode",
    "logits_of",
    "open_model",
]
