"""An image in any form a caller holds (bytes, a file, a PIL image, a uint8 array) -> uint8 pixels for a model, and
the kind of ``RequestError`` a bad image raises: one decoding for the HTTP service and ``capserve predict``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from capserve.data.images import (
    ImageError,
    ImageTooLargeError,
    ImageTooSmallError,
    UnsupportedImageError,
    image_to_array,
    load_image,
)
from capserve.pipeline.errors import ErrorKind, RequestError
from capserve.runtime import Runtime

__all__ = ["IMAGE_ERRORS", "Upload", "decode"]

IMAGE_ERRORS: dict[type[ImageError], ErrorKind] = {
    ImageTooLargeError: ErrorKind.TOO_LARGE,
    ImageTooSmallError: ErrorKind.TOO_SMALL,
    UnsupportedImageError: ErrorKind.UNSUPPORTED,
}


# an image parameter: the bytes RequestGuard parsed (``guarded_upload``), a file, or what a Python caller holds
Upload = bytes | Path | Image.Image | np.ndarray


def _pixels(upload: Upload, runtime: Runtime, max_pixels: int) -> np.ndarray:
    """``decode`` without the translation of ``ImageError`` into ``RequestError``."""
    if isinstance(upload, np.ndarray):
        if upload.dtype != np.uint8 or upload.ndim not in (2, 3):
            raise ImageError(f"an image array must be uint8 (H, W) or (H, W, C), got {upload.dtype} {upload.shape}")
        upload = Image.fromarray(upload)
    if isinstance(upload, Image.Image):  # already decoded: the caller chose its size
        return image_to_array(upload, runtime.metadata)
    data = upload if isinstance(upload, bytes) else upload.read_bytes()
    return load_image(data, runtime.metadata, max_pixels)


def decode(upload: Upload, runtime: Runtime, max_pixels: int, what: str = "the image") -> np.ndarray:
    """An image → uint8 (C, H, W) for ``runtime``'s model; a bad one raises ``RequestError`` of its kind.

    ``what`` names the upload in messages (the client never sees BentoML's temporary file names).
    """
    try:
        return _pixels(upload, runtime, max_pixels)
    except ImageError as e:
        raise RequestError(IMAGE_ERRORS.get(type(e), ErrorKind.BAD_INPUT), f"{what}: {e}") from e
