"""TODO docstring."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image
from support.images import png_header_only

import capserve
from capserve.data.images import (
    EmptyImageError,
    ImageError,
    ImageTooLargeError,
    ImageTooSmallError,
    UndecodableImageError,
    UnsupportedImageError,
    decode_image,
    load_image,
    preprocess,
)
from capserve.data.preprocess import normalize, normalize_images

CIFAR = capserve.get_config("cifar10-resnet")  # 3 × 32 × 32


GRAY = capserve.get_config("cifar10-resnet", in_channels=1, mean=(0.5,), std=(0.25,))


def encode(image: Image.Image, fmt: str = "PNG", **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def rgb(seed: int = 0, size: tuple[int, int] = (32, 32)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)


def test_exact_size_rgb_png_is_untouched():
    pixels = rgb()
    out = load_image(encode(Image.fromarray(pixels)), CIFAR)
    assert out.dtype == np.uint8 and out.shape == (3, 32, 32)
    np.testing.assert_array_equal(out, pixels.transpose(2, 0, 1))


@pytest.mark.parametrize(
    "mode, value, fmt, expected",
    [
        ("L", 77, "PNG", (77, 77, 77)),
        ("1", 1, "PNG", (255, 255, 255)),
        ("RGB", (10, 20, 30), "PNG", (10, 20, 30)),
        ("RGBA", (200, 0, 0, 0), "PNG", (255, 255, 255)),  # fully transparent → the white background
        ("RGBA", (0, 0, 0, 255), "PNG", (0, 0, 0)),
        ("RGBA", (0, 0, 0, 128), "PNG", (127, 127, 127)),  # half transparent black over white
        ("LA", (0, 0), "PNG", (255, 255, 255)),
        ("I;16", 257 * 100, "PNG", (100, 100, 100)),
        ("I", 70000, "TIFF", (255, 255, 255)),  # above 16 bits: clipped
        ("I", 65535, "TIFF", (255, 255, 255)),
        ("F", 0.5, "TIFF", (128, 128, 128)),  # [0, 1] floats
        ("F", 100.0, "TIFF", (100, 100, 100)),  # [0, 255] floats
        ("CMYK", (0, 0, 0, 0), "JPEG", (255, 255, 255)),
        ("CMYK", (0, 0, 0, 255), "TIFF", (0, 0, 0)),
    ],
)
def test_every_mode_becomes_rgb(mode, value, fmt, expected):
    data = encode(Image.new(mode, (32, 32), value), fmt)
    out = load_image(data, CIFAR)
    assert out.shape == (3, 32, 32) and out.dtype == np.uint8
    np.testing.assert_allclose(out.reshape(3, -1).mean(axis=1), expected, atol=1.5)


def test_palette_with_transparency_composites_on_white():
    image = Image.new("P", (32, 32), 0)
    image.putpalette([255, 0, 0, 0, 0, 255] + [0] * 762)
    image.paste(1, (0, 0, 16, 32))  # left half index 1 (blue), right half index 0 (red, transparent)
    out = load_image(encode(image, transparency=0), CIFAR)
    np.testing.assert_array_equal(out[:, 0, 0], (0, 0, 255))
    np.testing.assert_array_equal(out[:, 0, 31], (255, 255, 255))
    opaque = load_image(encode(image), CIFAR)
    np.testing.assert_array_equal(opaque[:, 0, 31], (255, 0, 0))


def test_gray_model_gets_luma():
    out = load_image(encode(Image.new("RGB", (32, 32), (255, 0, 0))), GRAY)
    assert out.shape == (1, 32, 32)
    assert int(out[0, 0, 0]) == 76  # ITU-R 601: 0.299 × 255


def test_exif_orientation_is_applied():
    pixels = np.zeros((20, 40, 3), np.uint8)  # 40 wide, 20 high; left half white
    pixels[:, :20] = 255
    image = Image.fromarray(pixels)
    exif = image.getexif()
    exif[0x0112] = 6  # "rotate 90° clockwise to display"
    decoded = decode_image(encode(image, exif=exif))
    assert decoded.size == (20, 40)
    a = np.asarray(decoded)
    assert a[0, :, 0].mean() == 255 and a[-1, :, 0].mean() == 0  # the white half is now on top


def test_animated_gif_uses_first_frame():
    frames = [Image.new("RGB", (32, 32), c) for c in ((255, 0, 0), (0, 0, 255), (0, 255, 0))]
    data = encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)
    assert Image.open(io.BytesIO(data)).n_frames == 3
    out = load_image(data, CIFAR)
    np.testing.assert_allclose(out.reshape(3, -1).mean(axis=1), (255, 0, 0), atol=2)


def test_resize_policy_center_square_bilinear():
    pixels = np.zeros((64, 96, 3), np.uint8)  # 96 wide: a 64×64 red centre with 16-pixel blue sides
    pixels[:, :, 2] = 255
    pixels[:, 16:80] = (255, 0, 0)
    out = load_image(encode(Image.fromarray(pixels)), CIFAR)
    assert out.shape == (3, 32, 32)
    assert out[0].min() >= 250 and out[2].max() <= 5  # only the central square remains
    # same as Pillow's bilinear resize of the crop
    expected = np.asarray(Image.fromarray(pixels[:, 16:80]).resize((32, 32), Image.Resampling.BILINEAR))
    np.testing.assert_allclose(out.transpose(1, 2, 0).astype(int), expected.astype(int), atol=1)
    up = load_image(encode(Image.fromarray(rgb(1, (16, 12)))), CIFAR)  # upscaling works too
    assert up.shape == (3, 32, 32)


def test_preprocess_equals_torch_normalize():
    data = encode(Image.fromarray(rgb(2)))
    x = preprocess(data, CIFAR)
    assert x.dtype == np.float32 and x.shape == (1, 3, 32, 32)
    u8 = torch.from_numpy(load_image(data, CIFAR)[None])
    np.testing.assert_array_equal(x, normalize(u8, CIFAR.mean, CIFAR.std).numpy())


def test_normalisation_against_literal_numbers():
    """(x / 255 - mean) / std worked out by hand: the comparison above cannot see a wrong formula shared by both."""
    pixels = np.array([0, 51, 102, 255], np.uint8).reshape(1, 1, 1, 4)  # x / 255 = 0, 0.2, 0.4, 1
    expected = np.array([-0.5, 0.0, 0.5, 2.0], np.float32).reshape(1, 1, 1, 4)  # mean 0.2, std 0.4
    np.testing.assert_allclose(normalize(torch.from_numpy(pixels), (0.2,), (0.4,)).numpy(), expected, atol=1e-6)
    np.testing.assert_allclose(normalize_images(pixels, GRAY), [[[[-2.0, -1.2, -0.4, 2.0]]]], atol=1e-6)
    # a solid (255, 0, 51) PNG through the whole policy, CIFAR-10's mean (0.4914, 0.4822, 0.4465) and std
    # (0.2023, 0.1994, 0.201): (1 - 0.4914) / 0.2023, (0 - 0.4822) / 0.1994, (0.2 - 0.4465) / 0.201
    x = preprocess(encode(Image.new("RGB", (40, 40), (255, 0, 51))), CIFAR)
    assert x.shape == (1, 3, 32, 32)
    for channel, value in enumerate((2.514088, -2.418255, -1.226368)):
        np.testing.assert_allclose(x[0, channel], np.full((32, 32), value, np.float32), atol=1e-5)


def truncated(fmt: str) -> bytes:
    data = encode(Image.fromarray(rgb(3, (64, 64))), fmt, **({"quality": 95} if fmt == "JPEG" else {}))
    return data[: len(data) // 2]


@pytest.mark.parametrize(
    "data, error",
    [
        (b"", EmptyImageError),
        (b"this is not an image at all", UndecodableImageError),
        (b"\x89PNG\r\n\x1a\n" + b"\0" * 40, UndecodableImageError),
        (truncated("PNG"), UndecodableImageError),
        (truncated("JPEG"), UndecodableImageError),
        (png_header_only(100_000, 100_000), ImageTooLargeError),  # Pillow's own bomb limit
        (png_header_only(6000, 6000), ImageTooLargeError),  # ours (25 M)
        (encode(Image.new("RGB", (1, 1))), ImageTooSmallError),
        (encode(Image.new("RGB", (300, 2))), ImageTooSmallError),
        (png_header_only(0, 10), ImageError),
    ],
    ids=["empty", "text", "png-signature", "truncated-png", "truncated-jpeg", "bomb", "limit", "1x1", "thin", "zero"],
)
def test_bad_images_raise_clear_errors(data, error):
    with pytest.raises(error) as info:
        load_image(data, CIFAR)
    assert isinstance(info.value, ValueError) and str(info.value)


def test_pixel_limit_is_configurable():
    data = encode(Image.fromarray(rgb(4, (40, 40))))
    load_image(data, CIFAR, max_pixels=1600)
    with pytest.raises(ImageTooLargeError, match="1,599"):
        load_image(data, CIFAR, max_pixels=1599)


@pytest.mark.parametrize("side", [10_000, 14_000])  # past Pillow's refusal and past its warning
def test_an_image_past_pillows_bomb_limit_is_told_the_limit_in_force(side):
    """Pillow refuses these before capserve's own check: the message still gives the image's pixels and the
    limit the user set, not Pillow's."""
    with pytest.raises(ImageTooLargeError) as info:
        load_image(png_header_only(side, side), CIFAR, max_pixels=25_000_000)
    assert str(info.value) == (
        f"the image is {side * side:,} pixels; the limit is 25,000,000 pixels (resize it before sending)"
    )


def test_unsupported_channel_count():
    with pytest.raises(UnsupportedImageError, match="channels"):
        load_image(
            encode(Image.fromarray(rgb())),
            capserve.get_config("cifar10-resnet", in_channels=2, mean=(0, 0), std=(1, 1)),
        )
