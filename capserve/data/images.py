"""Image bytes → the model's input: decode, orient, convert, resize, normalise.

One policy, used by the service, the CLI and tests alike, read from the model's own metadata:

1. **Decode** with Pillow from bytes (never trusting a client's Content-Type). Only the first frame of an
   animation (GIF, APNG, WebP, multi-page TIFF) is used. An image with more than ``max_pixels`` pixels is
   refused *before* its pixels are decoded (decompression bombs); so is one with a side under ``min_side``.
2. **Orient** by the EXIF orientation tag, as a phone camera meant it.
3. **Convert** any mode to the model's channels. Transparency (RGBA, LA, PA, P with a transparent colour) is
   composited over **white**, the background of a document or a web page. CMYK and YCbCr go through Pillow's
   conversion to RGB. 16- and 32-bit integer images (I;16, I) are scaled from [0, 65535] to [0, 255] (values
   above are clipped); float images (F) are read as [0, 1] when their maximum is at most 1, else as [0, 255].
   Grayscale becomes RGB by repeating the channel; RGB becomes grayscale by ITU-R 601 luma.
4. **Resize**: the central square crop (the full shorter side; an odd margin leaves the extra pixel on the right or
   bottom) is resized to ``image_size``² with bilinear filtering, which Pillow antialiases when shrinking. An
   image already ``image_size``² is left untouched, so a 32×32 CIFAR-10 picture reaches the model pixel for pixel.
5. **Normalise**: uint8 (C, H, W) → ``capserve.data.preprocess.normalize_numpy`` with the model's mean and std.

Every failure raises an ``ImageError`` (a ``ValueError``) subclass whose message says what was wrong.
"""

from __future__ import annotations

import io
import re
import struct
import warnings

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from capserve.data.preprocess import InputSpec, normalize_images

# what counts as an image file in a folder (own data, `capserve verify --images`)
IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff"})
DEFAULT_MAX_PIXELS = 25_000_000  # 5000×5000: far above any photo worth classifying at 32×32, far below a bomb


DEFAULT_MIN_SIDE = 8  # a smaller image says too little to upscale into a prediction


WHITE = (255, 255, 255)


class ImageError(ValueError):
    """An upload that cannot become a model input; the message says why."""


class EmptyImageError(ImageError):
    """No bytes at all."""


class UndecodableImageError(ImageError):
    """Bytes that are not an image Pillow can read, or an image cut short."""


class ImageTooLargeError(ImageError):
    """More pixels than the configured limit (a decompression bomb, or just too big)."""


class ImageTooSmallError(ImageError):
    """Zero-sized, or a side below the minimum."""


class UnsupportedImageError(ImageError):
    """A pixel mode or channel count with no defined conversion to the model's channels."""


def decode_image(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS, min_side: int = DEFAULT_MIN_SIDE) -> Image.Image:
    """Decode the first frame of ``data``, EXIF-oriented, fully loaded (so truncation is caught here).

    Raises:
        EmptyImageError: ``data`` is empty.
        UndecodableImageError: Pillow cannot decode it (not an image, truncated).
        ImageTooLargeError: more than ``max_pixels`` pixels (checked from the header, before decoding).
        ImageTooSmallError: zero-sized, or a side under ``min_side``.
    """
    if not data:
        raise EmptyImageError("the image is empty (0 bytes); send the file's contents")
    try:
        with warnings.catch_warnings():
            # our own limit is checked below; Pillow's global one must not only warn
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        # Pillow refuses past its own limit before ours is checked: the message gives the limit in force here
        found = re.search(r"\((\d+) pixels\)", str(e))
        pixels = f"{int(found.group(1)):,} pixels" if found else "over Pillow's limit"
        limit = min(max_pixels, Image.MAX_IMAGE_PIXELS or max_pixels)
        raise ImageTooLargeError(
            f"the image is {pixels}; the limit is {limit:,} pixels (resize it before sending)"
        ) from e
    except UnidentifiedImageError as e:
        raise UndecodableImageError(
            "the data is not an image format this server reads (PNG, JPEG, GIF, WebP, BMP, TIFF, ...)"
        ) from e
    except (OSError, ValueError, SyntaxError, EOFError) as e:  # Pillow plugins raise all of these on bad headers
        raise UndecodableImageError(f"the image header is corrupt: {e}") from e
    width, height = image.size  # from the header: nothing decoded yet
    if width * height > max_pixels:
        raise ImageTooLargeError(
            f"the image is {width}×{height} = {width * height:,} pixels; the limit is "
            f"{max_pixels:,} pixels (resize it before sending)"
        )
    if min(width, height) < min_side:
        raise ImageTooSmallError(f"the image is {width}×{height}; each side must be at least {min_side} pixels")
    try:
        image.seek(0)  # first frame of an animation
        image.load()
        image = ImageOps.exif_transpose(image)
    except (OSError, ValueError, SyntaxError, EOFError, IndexError, struct.error) as e:
        raise UndecodableImageError(f"the image data is truncated or corrupt: {e}") from e
    return image


def _flatten_alpha(image: Image.Image) -> Image.Image:
    """Composite an image with transparency over white; RGB (or L) out."""
    gray = image.mode == "LA"
    rgba = image.convert("RGBA")
    background = Image.new("RGBA", rgba.size, (*WHITE, 255))
    flat = Image.alpha_composite(background, rgba).convert("RGB")
    return flat.convert("L") if gray else flat


def _to_8bit(image: Image.Image) -> Image.Image:
    """I;16, I and F images → L, by the scaling in the module docstring."""
    if image.mode == "F":
        a = np.asarray(image, dtype=np.float32)
        if not np.isfinite(a).all():
            raise UnsupportedImageError("the float image holds NaN or infinite values")
        scale = 255.0 if a.max(initial=0.0) <= 1.0 else 1.0
        return Image.fromarray(np.clip(np.rint(a * scale), 0, 255).astype(np.uint8), "L")
    a = np.asarray(image).astype(np.int64)  # I;16 (any byte order) and I
    return Image.fromarray((np.clip(a, 0, 65535) * 255 // 65535).astype(np.uint8), "L")


def to_channels(image: Image.Image, channels: int) -> Image.Image:
    """Convert any Pillow mode to "L" (channels=1) or "RGB" (channels=3)."""
    if channels not in (1, 3):
        raise UnsupportedImageError(f"models with {channels} input channels have no image conversion; use 1 or 3")
    mode = image.mode
    if mode == "P":
        image = image.convert("RGBA" if "transparency" in image.info else "RGB")
    elif mode.startswith("I") or mode == "F":
        image = _to_8bit(image)
    elif mode == "1":
        image = image.convert("L")
    if image.mode in ("RGBA", "LA", "RGBa", "PA"):
        image = _flatten_alpha(image)
    if image.mode not in ("L", "RGB"):
        try:
            image = image.convert("RGB")  # CMYK, YCbCr, HSV, ...
        except (ValueError, OSError) as e:
            raise UnsupportedImageError(f"cannot convert a {mode} image to RGB: {e}") from e
    return image.convert("L" if channels == 1 else "RGB")


def resize_center(image: Image.Image, size: int) -> Image.Image:
    """The central square (side = the shorter side) resized to size×size, bilinear (antialiased)."""
    width, height = image.size
    if (width, height) == (size, size):
        return image
    side = min(width, height)
    left, top = (width - side) // 2, (height - side) // 2
    square = image.crop((left, top, left + side, top + side))  # pixels outside it never blend in
    return square if side == size else square.resize((size, size), Image.Resampling.BILINEAR)


def image_to_array(image: Image.Image, spec: InputSpec) -> np.ndarray:
    """A decoded image → uint8 (C, H, W) in the model's channels and size."""
    image = resize_center(to_channels(image, spec.in_channels), spec.image_size)
    a = np.asarray(image, dtype=np.uint8)  # (H, W) or (H, W, 3)
    return np.ascontiguousarray(a[None] if a.ndim == 2 else a.transpose(2, 0, 1))  # (C, H, W)


def load_image(
    data: bytes, spec: InputSpec, max_pixels: int = DEFAULT_MAX_PIXELS, min_side: int = DEFAULT_MIN_SIDE
) -> np.ndarray:
    """Image bytes → uint8 (C, H, W) ready for ``normalize``; raises an ``ImageError`` subclass."""
    return image_to_array(decode_image(data, max_pixels, min_side), spec)


def preprocess(data: bytes, spec: InputSpec, max_pixels: int = DEFAULT_MAX_PIXELS) -> np.ndarray:
    """Image bytes → float32 (1, C, H, W), the whole policy of this module.

    Example:
        >>> runtime = capserve.runtime.load_runtime("models/cifar10")
        >>> logits = runtime.predict(preprocess(open("cat.png", "rb").read(), runtime.metadata))  # (1, 10)
    """
    return normalize_images(load_image(data, spec, max_pixels)[None], spec)
