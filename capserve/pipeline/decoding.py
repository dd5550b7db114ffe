"""Image bytes -> uint8 pixels for a model, and the error a bad image raises (``RequestError``, with the status the
README's error table gives it): one decoding for the HTTP service and ``capserve predict``."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from capserve.data.images import ImageError, ImageTooLargeError, ImageTooSmallError, UnsupportedImageError, load_image
from capserve.runtime import Runtime


class RequestError(ValueError):
    """A request the service refuses; ``status`` is its HTTP status (the README's error table)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


IMAGE_ERRORS: dict[type[ImageError], int] = {
    ImageTooLargeError: 413,
    ImageTooSmallError: 422,
    UnsupportedImageError: 422,
}


Upload = bytes | Path  # an image parameter: the bytes RequestGuard parsed (``guarded_upload``), or a file


def decode(upload: Upload, runtime: Runtime, max_pixels: int, what: str = "the image") -> np.ndarray:
    """An uploaded image → uint8 (C, H, W) for ``runtime``'s model; bad images raise ``RequestError``.

    ``what`` names the upload in messages (the client never sees BentoML's temporary file names).
    """
    data = upload if isinstance(upload, bytes) else upload.read_bytes()
    try:
        return load_image(data, runtime.metadata, max_pixels)
    except ImageError as e:
        raise RequestError(IMAGE_ERRORS.get(type(e), 400), f"{what}: {e}") from e
