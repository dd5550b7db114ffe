"""Image -> answer, below both the HTTP service (``capserve.serving``) and offline prediction
(``capserve.predict``), so that both answer alike. ``Answerer`` is the one composition every caller uses (images
in, answers or ``RequestError``s out); its steps live in ``models`` (opening a model from ``OpenOptions`` or the
service's settings), ``decoding`` (an image -> pixels), ``inference`` (pixels -> logits), ``answers`` and
``schemas`` (the answers), ``explain`` (the routing parse and occlusion maps). ``errors`` says what went wrong as
an ``ErrorKind``, which each caller maps to its own transport (an HTTP status, a row of ``capserve predict``)."""

from __future__ import annotations

from capserve.pipeline.answerer import Answer, Answerer
from capserve.pipeline.decoding import Upload, decode
from capserve.pipeline.errors import ErrorKind, RequestError
from capserve.pipeline.inference import logits_of
from capserve.pipeline.models import OpenOptions, open_model
from capserve.pipeline.schemas import Classification, Explained, MultiLabel

__all__ = [
    "Answer",
    "Answerer",
    "Classification",
    "ErrorKind",
    "Explained",
    "MultiLabel",
    "OpenOptions",
    "RequestError",
    "Upload",
    "decode",
    "logits_of",
    "open_model",
]
