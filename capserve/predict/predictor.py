"""``Predictor``: a model, its runtime and the service's preprocessing and decision rule, callable on a batch of
images outside any server: paths, bytes, PIL images or uint8 arrays in, the answers ``/classify`` or ``/multilabel``
would give out (one record per image, an error record for an image that cannot be read).

It is also a Ray Data callable class: ``ds.map_batches(Predictor, fn_constructor_kwargs={"model": ...},
batch_size=64, concurrency=4)`` on a data set with a ``path`` column (``ray.data.from_items``) or the ``image``
column of ``ray.data.read_images`` (docs/predict.md).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from capserve.data.images import DEFAULT_MAX_PIXELS
from capserve.pipeline.answerer import Answer, Answerer
from capserve.pipeline.decoding import Upload
from capserve.pipeline.errors import ErrorKind, RequestError
from capserve.pipeline.models import OpenOptions, open_model

__all__ = ["RECORDED", "Item", "Predictor", "record", "upload"]

Item = str | Path | bytes | Image.Image | np.ndarray


# each kind of refusal → True: the image's row says why and the run goes on; False: the run stops, for a kind that
# is a state of a server rather than a fault of one image (no image of ``capserve predict`` meets one)
RECORDED: dict[ErrorKind, bool] = {
    ErrorKind.BAD_INPUT: True,
    ErrorKind.TOO_LARGE: True,
    ErrorKind.TOO_SMALL: True,
    ErrorKind.UNSUPPORTED: True,
    ErrorKind.UNAVAILABLE: False,
    ErrorKind.BUSY: False,
}


def record(result: Answer | RequestError) -> dict[str, Any]:
    """One image's row: the JSON body the server would send, or ``{"error": "the image: ..."}`` (the server's
    words); a refusal ``RECORDED`` does not keep as a row raises."""
    if not isinstance(result, RequestError):
        return result.model_dump()
    if not RECORDED[result.kind]:
        raise result
    return {"error": str(result)}


def upload(item: Item) -> Upload | RequestError:
    """An item as the pipeline takes it: a file read into bytes, anything else as it is; a file that cannot be read
    (or a PIL image whose data cannot be loaded) is refused in its place, as the server words a bad image."""
    try:
        if isinstance(item, (str, Path)):
            return Path(item).read_bytes()
        if isinstance(item, Image.Image):
            item.load()
    except OSError as e:
        return RequestError(ErrorKind.BAD_INPUT, f"the image: {e}")
    return item


class Predictor:
    """A model opened once, answering batches of images as the server does (``capserve.pipeline.Answerer``).

    Args:
        model: what ``capserve serve`` takes: a model folder, an exported ``.onnx`` (or INT8) file, a TensorRT
            engine, or ``NAME[:VERSION]`` in BentoML's model store.
        backend, device, precision, iterations: as the service's ``CAPSERVE_*`` settings.
        top_k: single-label answers: how many labels (``/classify``'s ``top_k``); None: up to 5, never more than
            the model has. Multi-label answers take no ``top_k``, and ignore it.
        threshold: multi-label answers: one threshold for every label (``/multilabel``'s ``threshold``); None: the
            model's own. Out of range, either raises ``ValueError`` in the server's words
            (``capserve.runtime.outputs.answer_options``).
    Example:
        >>> predictor = Predictor("models/cifar10")
        >>> predictor.predict(["cat.png", "dog.jpg"])[0]["predictions"][0]["label"]
        'cat'
    """

    def __init__(
        self,
        model: str = "models/cifar10",
        *,
        backend: str = "onnxruntime",
        device: str = "cpu",
        precision: str = "auto",
        iterations: int | None = None,
        top_k: int | None = None,
        threshold: float | None = None,
        max_pixels: int = DEFAULT_MAX_PIXELS,
    ) -> None:
        options = OpenOptions(backend=backend, device=device, precision=precision, iterations=iterations)
        self.runtime, _, self.source = open_model(str(model), options, explain=False)
        self.metadata = self.runtime.metadata
        self.answerer = Answerer(self.runtime, max_pixels)  # answers as the model's task: /classify or /multilabel
        self.top_k, self.threshold = self.answerer.options(top_k, threshold)

    def pixels(self, item: Item) -> np.ndarray | RequestError:
        """One image → uint8 (C, H, W) for the model, by the service's own decoding, or the ``RequestError`` that
        refused it (the server's words)."""
        return self.answerer.decoded(upload(item))

    def answer(self, decoded: Sequence[np.ndarray | RequestError]) -> list[dict[str, Any]]:
        """What ``pixels`` gave for each image → one row per image, in order (``record``)."""
        return [record(r) for r in self.answerer.answer_pixels(decoded, self.top_k, self.threshold)]

    def predict(self, items: Sequence[Item]) -> list[dict[str, Any]]:
        """One record per item, in order: the answer, or ``{"error": "the image: ..."}`` (the server's words)."""
        results = self.answerer.answer([upload(item) for item in items], self.top_k, self.threshold)
        return [record(r) for r in results]

    def __call__(self, batch: dict[str, Any]) -> dict[str, np.ndarray]:
        """Ray Data's ``map_batches``: a batch with a ``path`` column (files) or an ``image`` column (arrays, as
        ``read_images`` gives them) → columns ``path`` (when given), ``answer`` (the JSON body, or empty) and
        ``error`` (empty, or why the image could not be read)."""
        items = batch["image"] if "image" in batch else batch["path"]
        records = self.predict(list(items))
        out = {
            "answer": np.array(["" if "error" in r else json.dumps(r) for r in records], dtype=object),
            "error": np.array([r.get("error", "") for r in records], dtype=object),
        }
        if "path" in batch:
            out["path"] = np.asarray(batch["path"], dtype=object)
        return out
