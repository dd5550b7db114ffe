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

from capserve.data.images import DEFAULT_MAX_PIXELS, ImageError, image_to_array
from capserve.pipeline.decoding import RequestError, decode
from capserve.pipeline.inference import answers_of
from capserve.pipeline.models import OpenOptions, open_model
from capserve.runtime.outputs import answer_options

Item = str | Path | bytes | Image.Image | np.ndarray


def pixels_or_error(predictor: Predictor, item: Item) -> np.ndarray | str:
    """``predictor.pixels(item)``, or the error record's words: the server's for an image, ``the image: ...``
    otherwise."""
    try:
        return predictor.pixels(item)
    except RequestError as e:
        return str(e)
    except (ImageError, OSError) as e:
        return f"the image: {e}"


class Predictor:
    """A model opened once, answering batches of images as the server does.

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
        self.metadata = meta = self.runtime.metadata
        self.multi_label = meta.task == "multi_label"
        self.top_k, self.threshold = answer_options(len(meta.labels), top_k, threshold, self.multi_label)
        self.max_pixels = max_pixels

    def pixels(self, item: Item) -> np.ndarray:
        """One image → uint8 (C, H, W) for the model, by the service's own decoding; ``RequestError`` (bytes and
        files: the server's message), ``ImageError`` (arrays) or ``OSError`` (a file that cannot be read)."""
        if isinstance(item, (str, Path)):
            item = Path(item).read_bytes()
        if isinstance(item, bytes):
            return decode(item, self.runtime, self.max_pixels)  # the service's decoding and words
        if isinstance(item, np.ndarray):
            if item.dtype != np.uint8 or item.ndim not in (2, 3):
                raise ImageError(f"an image array must be uint8 (H, W) or (H, W, C), got {item.dtype} {item.shape}")
            item = Image.fromarray(item)
        return image_to_array(item, self.metadata)

    def answer(self, pixels: np.ndarray) -> list[dict[str, Any]]:
        """uint8 (B, C, H, W) → the answers, as the JSON bodies the server would send."""
        answers = answers_of(self.runtime, pixels, self.top_k, self.threshold)  # the service's own answers
        return [a.model_dump() for a in answers]

    def predict(self, items: Sequence[Item]) -> list[dict[str, Any]]:
        """One record per item, in order: the answer, or ``{"error": "the image: ..."}`` (the server's words)."""
        decoded: list[np.ndarray | str] = []
        for item in items:
            decoded.append(pixels_or_error(self, item))
        good = [d for d in decoded if isinstance(d, np.ndarray)]
        answers = iter(self.answer(np.stack(good)) if good else [])
        return [next(answers) if isinstance(d, np.ndarray) else {"error": d} for d in decoded]

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
