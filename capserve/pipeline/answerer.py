"""``Answerer``: images → answers for one model, the one composition of the pipeline's steps that every caller uses
(the HTTP service's routes, ``capserve predict`` and ``Predictor``), so that all of them answer alike.

The steps are methods too: ``options`` (``top_k``, ``threshold`` checked), ``decode`` (an image → pixels),
``outputs`` (pixels → logits and unfamiliarity) and ``answers`` (those → answers). The service's adaptive batching
runs its batches
between ``decode`` and ``answers`` (``capserve.serving.batching``), and ``capserve predict`` decodes ahead of
``answer_pixels`` in a thread pool; everything else calls ``answer``."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from capserve.data.images import DEFAULT_MAX_PIXELS
from capserve.pipeline.answers import classifications, multilabel_answers
from capserve.pipeline.decoding import Upload, decode
from capserve.pipeline.errors import ErrorKind, RequestError
from capserve.pipeline.inference import Outputs, logits_of, outputs_of
from capserve.pipeline.schemas import Classification, MultiLabel
from capserve.runtime import Runtime
from capserve.runtime.outputs import answer_options

__all__ = ["Answer", "Answerer"]

Answer = Classification | MultiLabel


class Answerer:
    """One model's images → answers.

    Args:
        runtime: the model's runtime (``capserve.pipeline.models.open_model``).
        max_pixels: the most pixels an encoded image may have (decompression bombs).
        batch_size: images per inference call in ``answer``; None: all at once.
        multi_label: which answers: ``/multilabel``'s (True) or ``/classify``'s (False); None: by the model's task.
    Example:
        >>> answerer = Answerer(open_model("models/cifar10", OpenOptions())[0])
        >>> answerer.answer([open("cat.png", "rb").read()], top_k=1)[0].predictions[0].label
        'cat'
    """

    def __init__(
        self,
        runtime: Runtime,
        max_pixels: int = DEFAULT_MAX_PIXELS,
        batch_size: int | None = None,
        multi_label: bool | None = None,
    ) -> None:
        self.runtime, self.max_pixels, self.batch_size = runtime, max_pixels, batch_size
        self.metadata = runtime.metadata
        self.multi_label = self.metadata.task == "multi_label" if multi_label is None else multi_label

    def options(self, top_k: int | None = None, threshold: float | None = None) -> tuple[int, float | None]:
        """A request's ``top_k`` and ``threshold`` checked for this model (``answer_options``); out of range:
        ``RequestError`` (``BAD_INPUT``) in the words of ``answer_options``."""
        try:
            return answer_options(len(self.metadata.labels), top_k, threshold, self.multi_label)
        except ValueError as e:
            raise RequestError(ErrorKind.BAD_INPUT, str(e)) from e

    def decode(self, upload: Upload, what: str = "the image", max_pixels: int | None = None) -> np.ndarray:
        """One image → uint8 (C, H, W), up to ``max_pixels`` (default: this answerer's limit); a bad image raises
        ``RequestError`` of its kind, its message starting with ``what``."""
        return decode(upload, self.runtime, max_pixels or self.max_pixels, what)

    def decoded(self, upload: Upload | RequestError, what: str = "the image") -> np.ndarray | RequestError:
        """``decode``, or the ``RequestError`` that refused the image in its place (an item that already is one, a
        file its caller could not read, stays as it is)."""
        if isinstance(upload, RequestError):
            return upload
        try:
            return self.decode(upload, what)
        except RequestError as e:
            return e

    def logits(self, pixels: np.ndarray, batch_size: int | None = None) -> np.ndarray:
        """uint8 (B, C, H, W) → float32 logits (B, classes), ``batch_size`` images at a time (default all)."""
        return logits_of(self.runtime, pixels, batch_size)

    def outputs(self, pixels: np.ndarray, batch_size: int | None = None) -> Outputs:
        """uint8 (B, C, H, W) → the logits and each image's unfamiliarity (``outputs_of``)."""
        return outputs_of(self.runtime, pixels, batch_size)

    def answers(self, outputs: Outputs, top_k: int, threshold: float | None) -> list[Answer]:
        """``Outputs`` of B images → one answer per image, for ``top_k`` and ``threshold`` as ``options`` gives
        them."""
        if self.multi_label:
            return multilabel_answers(outputs.logits, self.metadata, threshold, outputs.unfamiliarity)
        return classifications(outputs.logits, self.metadata, top_k, outputs.unfamiliarity)

    def answer_pixels(
        self, decoded: Sequence[np.ndarray | RequestError], top_k: int, threshold: float | None
    ) -> list[Answer | RequestError]:
        """Decoded images uint8 (C, H, W), or the error that refused one, → one answer per image in order, the
        errors in their places; the images run through the model together, ``batch_size`` at a time."""
        good = [d for d in decoded if isinstance(d, np.ndarray)]
        outputs = self.outputs(np.stack(good), self.batch_size) if good else None
        answers = iter(self.answers(outputs, top_k, threshold) if outputs is not None else [])
        return [next(answers) if isinstance(d, np.ndarray) else d for d in decoded]

    def answer(
        self,
        uploads: Sequence[Upload | RequestError],
        top_k: int | None = None,
        threshold: float | None = None,
        all_or_none: bool = False,
    ) -> list[Answer | RequestError]:
        """Images → one answer per image in order, or the ``RequestError`` that refused it in its place
        (``decoded``). Options out of range raise
        ``RequestError`` before any image is decoded.

        ``all_or_none``: the images are one request (``/classify_batch``), so the first bad one raises its
        ``RequestError``, which names it by its position (``image 2: ...``), before any inference. Else each
        image is answered or refused on its own (``the image: ...``)."""
        top_k, threshold = self.options(top_k, threshold)
        decoded: list[np.ndarray | RequestError] = []
        for i, upload in enumerate(uploads):
            pixels = self.decoded(upload, _what(i, all_or_none))
            if all_or_none and isinstance(pixels, RequestError):
                raise pixels
            decoded.append(pixels)
        return self.answer_pixels(decoded, top_k, threshold)


def _what(index: int, numbered: bool) -> str:
    """How a message names image ``index``: by its position in a request of several, else ``the image``."""
    return f"image {index}" if numbered else "the image"
